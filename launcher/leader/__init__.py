"""The leader: the one launcher that runs the job -- its policy, its loop, its leadership, the
rendezvous it serves, and the watchdogs over its ranks."""
