"""Ring epochs: the model of members and ranks shared by the launcher and the workers."""
