"""Every name elastic-allreduce gives things on Kubernetes, each defined here and nowhere else.

Label and annotation keys and values, the names of a job's objects and pods, label selectors,
the shared objects of a namespace (etcd) and of a cluster (the PriorityClass), and where the
launcher pod finds the worker template. The manifests (``manifests``), the provisioner
(``provisioner``), the Events (``events``) and ``elastic-run k8s`` (``cli``) all take their names
from here, so that what one writes the others select. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

# -- labels and annotations --------------------------------------------------------------------

#: The recommended "name of the application" label: every object of elastic-allreduce has it,
#: and the etcd's NetworkPolicy admits clients by it.
NAME_LABEL: Final = "app.kubernetes.io/name"
#: The recommended "part of a higher-level application" label (the etcd's objects).
PART_OF_LABEL: Final = "app.kubernetes.io/part-of"
#: Value of NAME_LABEL on a job's objects, and of PART_OF_LABEL on the etcd's.
APP_NAME: Final = "elastic-allreduce"
#: The job id; ``k8s status`` and ``k8s delete`` select a job's objects by it.
JOB_LABEL: Final = "elastic-allreduce/job"
#: On pods only: ROLE_LAUNCHER or ROLE_WORKER.
ROLE_LABEL: Final = "elastic-allreduce/role"
ROLE_LAUNCHER: Final = "launcher"
ROLE_WORKER: Final = "worker"
#: Annotation of the launcher's pod: the running ring ("epoch N: K ranks [slots]").
RING_ANNOTATION: Final = "elastic-allreduce/ring"
#: Annotation of a worker pod: the token of the create that made it, so that a create whose
#: answer was lost (and that is tried again) recognises its own pod in a 409.
CREATION_ANNOTATION: Final = "elastic-allreduce/creation"

#: Source component of the Events the launcher records.
EVENT_COMPONENT: Final = "elastic-allreduce-launcher"

#: The extended resource of NVIDIA GPUs (the device plugin's), and the taint GPU pools carry.
GPU_RESOURCE: Final = "nvidia.com/gpu"

# -- shared objects ----------------------------------------------------------------------------

#: Defaults of the kustomize base (the default job).
DEFAULT_NAMESPACE: Final = "elastic-allreduce"
DEFAULT_JOB_ID: Final = "elastic-job"

#: The PriorityClass of preemptible training pods (cluster-scoped).
PRIORITY_CLASS: Final = "elastic-allreduce-preemptible"
#: The PriorityClass of launcher pods (cluster-scoped): above the workers' and the default.
LAUNCHER_PRIORITY_CLASS: Final = "elastic-allreduce-launcher"

#: A namespace's etcd: client Service and StatefulSet, and its headless peer Service.
ETCD_NAME: Final = "elastic-allreduce-etcd"
ETCD_PEER_SERVICE: Final = "elastic-allreduce-etcd-peer"
ETCD_CLIENT_PORT: Final = 2379
ETCD_PEER_PORT: Final = 2380
#: Plain-HTTP /health and /metrics of an etcd with TLS (its readiness probe needs no certificate).
ETCD_METRICS_PORT: Final = 2381
#: The Secret with the etcd's certificate, key and CA (``elastic-run certs``: docs/kubernetes.md),
#: mounted at ETCD_TLS_DIR in every member; its keys are TLS_CA, TLS_CERT and TLS_KEY.
ETCD_TLS_SECRET: Final = "elastic-allreduce-etcd-tls"  # noqa: S105 - a name
ETCD_TLS_DIR: Final = "/etc/etcd/tls"
#: Keys of the Secrets of etcd over TLS (those of a kubernetes.io/tls Secret, plus the CA).
TLS_CA: Final = "ca.crt"
TLS_CERT: Final = "tls.crt"
TLS_KEY: Final = "tls.key"
#: Key of a job's client Secret that holds its etcd user's password.
PASSWORD_KEY: Final = "password"  # noqa: S105 - a key name
#: Where a job's launcher and workers mount the job's etcd client Secret (etcd_client_secret).
ETCD_CLIENT_DIR: Final = "/etc/elastic-allreduce-etcd"

#: Where the launcher pod finds the worker pod template (the ConfigMap is mounted there).
TEMPLATE_DIR: Final = "/etc/elastic-allreduce"
TEMPLATE_KEY: Final = "worker-pod.yaml"
TEMPLATE_PATH: Final = f"{TEMPLATE_DIR}/{TEMPLATE_KEY}"

#: The checkpoint PersistentVolumeClaim of a namespace (``--checkpoint-claim``): every job of the
#: namespace mounts it at its ``--checkpoint-dir`` and keeps its checkpoints in its own folder.
CHECKPOINT_CLAIM: Final = "elastic-allreduce-checkpoints"
#: Name of the checkpoint volume in a job's pods.
CHECKPOINT_VOLUME: Final = "checkpoints"

#: The Pod Security Admission labels of a job's namespace: the "restricted" Pod Security
#: Standard, enforced (pods that break it are refused), audited and warned about.
POD_SECURITY_LABELS: Final = {
    f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "audit", "warn")
}

#: The cluster's ValidatingAdmissionPolicy that holds every job's launcher to its worker shape,
#: and its ValidatingAdmissionPolicyBinding (one of each per cluster: ``launcher.k8s.admission``).
ADMISSION_POLICY: Final = "elastic-allreduce-launcher-pods"
#: Label of the ConfigMaps whose data is a job's worker shape (the worker template's ConfigMap):
#: the binding takes them, in the namespace of each request, as the policy's parameters.
WORKER_SHAPE_LABEL: Final = "elastic-allreduce/worker-shape"
#: Keys of a job's worker shape in its template ConfigMap: the job id, the images its worker pods
#: may run, its launcher's and workers' service accounts, and the Secrets and claims its worker
#: pods may use (each list comma-separated, possibly empty).
SHAPE_JOB: Final = "job"
SHAPE_IMAGES: Final = "images"
SHAPE_LAUNCHER_ACCOUNT: Final = "launcherServiceAccount"
SHAPE_WORKER_ACCOUNT: Final = "workerServiceAccount"
SHAPE_SECRETS: Final = "secrets"
SHAPE_CLAIMS: Final = "claims"


def etcd_labels() -> dict[str, str]:
    """The labels of the etcd's objects (no job label: every job of the namespace shares it)."""
    return {NAME_LABEL: "etcd", PART_OF_LABEL: APP_NAME}


def default_etcd_endpoints(tls: bool = True) -> str:
    """The endpoint of the namespace's etcd, as pods of that namespace reach it (``https://``
    unless it runs without TLS)."""
    return f"{'https://' if tls else ''}{ETCD_NAME}:{ETCD_CLIENT_PORT}"


# -- a job's objects ---------------------------------------------------------------------------


def job_labels(job_id: str) -> dict[str, str]:
    """The labels of every object of a job."""
    return {NAME_LABEL: APP_NAME, JOB_LABEL: job_id}


def pod_labels(job_id: str, role: str) -> dict[str, str]:
    """The labels of a job's pod: the job's, and its role (ROLE_LAUNCHER or ROLE_WORKER)."""
    return {**job_labels(job_id), ROLE_LABEL: role}


def job_selector(job_id: str) -> str:
    """The label selector of every object of a job, for list and delete calls."""
    return f"{JOB_LABEL}={job_id}"


def worker_selector(job_id: str) -> str:
    """The label selector of a job's worker pods (what the provisioner watches)."""
    return f"{JOB_LABEL}={job_id},{ROLE_LABEL}={ROLE_WORKER}"


def same_job(job_id: str) -> dict[str, str]:
    """The matchLabels of a NetworkPolicy's selector for every pod of a job."""
    return {JOB_LABEL: job_id}


def launcher_name(job_id: str) -> str:
    """Name of the launcher's Job, ServiceAccount, Role, RoleBinding and (with
    ``--launcher-pdb``) PodDisruptionBudget."""
    return f"{job_id}-launcher"


def worker_service_account(job_id: str) -> str:
    """Name of the ServiceAccount of a job's worker pods (no rights, no token mounted)."""
    return f"{job_id}-worker"


def service_account_user(namespace: str, account: str) -> str:
    """The user name the Kubernetes API gives requests made with a service account's token."""
    return f"system:serviceaccount:{namespace}:{account}"


def template_name(job_id: str) -> str:
    """Name of the ConfigMap holding the worker pod template."""
    return f"{job_id}-worker-template"


def network_policy_name(job_id: str) -> str:
    """Name of the NetworkPolicy that closes a job's pods to everything but the job."""
    return job_id


def metrics_policy_name(job_id: str) -> str:
    """Name of the NetworkPolicy that lets scrapers reach the launcher's metrics port."""
    return f"{job_id}-launcher-metrics"


def api_policy_name(job_id: str) -> str:
    """Name of the NetworkPolicy that lets the launcher reach the Kubernetes API."""
    return f"{job_id}-launcher-api"


def etcd_client_secret(job_id: str) -> str:
    """Name of the Secret with a job's etcd client certificate, key, CA and password."""
    return f"{job_id}-etcd-client"


def worker_pod_name(job_id: str, number: int) -> str:
    """Name of a job's ``number``-th worker pod (the node id of its agent)."""
    return f"{job_id}-worker-{number}"
