"""Kubernetes manifests for a job (``render``), the API calls that apply them (``client``) and
the ``elastic-run k8s`` commands (``cli``). ``render`` is pure and needs no cluster."""
