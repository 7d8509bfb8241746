"""A training process's start under ``elastic-run``: registration, admission, the Gloo sockets
and the ring guard, Horovod's hooks, following the leader, the IPv6 relay, GPU selection.

``python -m elastic_allreduce.bootstrap SCRIPT [ARGS]`` runs :mod:`.process`."""
