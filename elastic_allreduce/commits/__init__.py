"""Commits kept: snapshots in shared memory, checkpoint folders, and the channel to the agent
that persists rank 0's snapshots."""
