"""Provisioners start and stop worker nodes: local processes, later Kubernetes pods."""
