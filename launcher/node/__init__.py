"""The node agent: one per worker node; registers the node, follows the leader and supervises
the node's training processes."""
