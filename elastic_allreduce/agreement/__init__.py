"""What the ranks agree on: the state's shape before a sync, plain-data attributes and the
host-update votes (never a pickle)."""
