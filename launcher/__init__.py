"""The control plane of elastic-allreduce: launcher, agents, provisioners and ``elastic-run``."""
