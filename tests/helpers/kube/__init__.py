"""A private Kubernetes control plane for the tests (issue 19): the upstream components built
from tools/kube/ (:mod:`tests.helpers.kube.cluster`) and a kubelet that runs pods as processes
in network namespaces (:mod:`tests.helpers.kube.kubelet`)."""
