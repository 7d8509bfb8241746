"""Everything elastic-allreduce does with Kubernetes.

- ``naming``: every label, annotation, object and pod name and selector, each defined once;
- ``errors``: the Kubernetes errors, inside the project's one exception tree;
- ``client``: the one API client (:class:`~launcher.k8s.client.Kube`) and the one way to make it
  (:func:`~launcher.k8s.client.connect`: explicit URL, kubeconfig or in-cluster);
- ``manifests``: a job's objects as plain dicts (pure: no cluster, no I/O);
- ``provisioner``: worker nodes as pods (the launcher's provisioner in Kubernetes mode);
- ``events``: membership changes as Events on the launcher's pod;
- ``mode``: Kubernetes mode of ``elastic-run run`` (the launcher in a pod);
- ``cli``: ``elastic-run k8s render|submit|status|delete``.
"""
