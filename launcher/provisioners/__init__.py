"""Provisioners start and stop worker nodes: the boundary (``api``) and local processes
(``local``); worker pods on Kubernetes are :mod:`launcher.k8s.provisioner`."""
