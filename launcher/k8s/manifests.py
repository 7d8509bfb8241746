"""The Kubernetes objects of one elastic job, as plain dicts (pure: no cluster, no I/O).

A :class:`JobSpec` is the job's options (:class:`~launcher.job_options.JobOptions`, the flags
``elastic-run run`` takes too) plus where and how it runs on the cluster (image, namespace,
resources, etcd, scheduling). ``render(JobSpec(...))`` returns, in the order to apply them:

- optionally the ``PriorityClass`` for preemptible training and the one for launchers
  (cluster-scoped, so only with ``with_priority_class``: creating them needs cluster rights that
  a job's submitter often lacks);
- optionally the cluster's admission policy for launchers (``with_admission_policy``:
  :mod:`launcher.k8s.admission`, cluster-scoped too, one for every job of the cluster);
- optionally a namespace's etcd (``with_etcd``): peer and client Services, a StatefulSet and the
  NetworkPolicy that lets only elastic-allreduce pods reach it. It carries no job label: jobs of
  one namespace share it, and deleting a job leaves it. Unless ``etcd_tls`` is off it serves
  clients and peers over TLS only and requires client certificates, from the Secret
  ``elastic-allreduce-etcd-tls``;
- optionally the namespace's checkpoint claim (``with_checkpoint_claim``: a ReadWriteMany
  PersistentVolumeClaim shared by the jobs of the namespace, each in its own folder);
- the launcher's ServiceAccount, Role and RoleBinding (pods create/get/list/watch/delete/patch
  and events create, nothing else), the workers' ServiceAccount (no rights, no token), the worker
  pod template in a ConfigMap (with the job's worker shape, the admission policy's parameters),
  the job's NetworkPolicies, optionally the launcher's PodDisruptionBudget
  (``launcher_disruption_budget``) and the launcher Job, each labelled ``elastic-allreduce/job:
  <job-id>``. The launcher Job runs ``elastic-run run --kubernetes`` with the job's flags
  (:func:`launcher.job_options.to_args`), so every job option reaches the launcher.

The launcher Job restarts its pod: a pod that fails (a crash, an OOM kill) is replaced up to
``backoffLimit`` times, and one that handed the job over (exit code 5: SIGTERM of a drain or an
eviction) or that the cluster disrupted (a ``DisruptionTarget`` condition: eviction, preemption,
node pressure) is replaced without counting; a pod that ended the job as failed (exit code 1) or
was given bad input (2) fails the Job at once. The new pod adopts the running job (its worker
pods belong to the Job: :mod:`launcher.k8s.provisioner`). Its PriorityClass is above the
workers' and the default, so a full cluster makes room for it (docs/kubernetes.md).

Every pod satisfies the "restricted" Pod Security Standard (non-root, no privilege escalation,
no capabilities, the runtime's default seccomp profile, only core volume types); the launcher's
and etcd's root filesystems are read-only (the launcher writes only to an emptyDir at /tmp and,
with a TensorBoard folder, to the checkpoint claim), the workers' are not (they run the user's
training script, which may write anywhere). With a ``--checkpoint-dir`` the worker pods mount
the checkpoint claim there; a ``--tensorboard-dir`` must be a folder inside it, which the
launcher then mounts too.

For a GPU job (``gpus_per_node``) the worker template asks for the GPUs and sets NCCL's socket
interface and TensorFlow's memory growth; the launcher, which needs no GPU, may run another
image (``launcher_image``: the CPU image) and is given none by the NVIDIA runtime either way.
Every worker's memory-backed ``/dev/shm`` has a size limit (docs/gpu.md says why for each).

With ``https://`` etcd endpoints (the default), the launcher and every worker mount the job's
Secret ``<job-id>-etcd-client`` (CA, client certificate and key, the password of the job's etcd
user, which is named like the job) and pass them as ``--etcd-cacert/--etcd-cert/--etcd-key/
--etcd-user/--etcd-password-file`` (the launcher) or their variables (the workers' ``join``).
The Secrets are made from ``elastic-run certs`` and ``elastic-run etcd-user`` (docs/kubernetes.md).

Names and labels come from :mod:`launcher.k8s.naming`.

The kustomize base in ``k8s/base`` holds the same objects for the default job
(``tests/k8s/test_manifests.py`` checks that they are equal).
"""

from __future__ import annotations

import copy
import importlib
import ipaddress
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError
from launcher import job_options
from launcher.exit_codes import EXIT_BAD_INPUT, EXIT_HANDED_OVER, EXIT_JOB_FAILED
from launcher.job_options import JobOptions
from launcher.k8s import admission
from launcher.k8s.naming import (
    APP_NAME,
    CHECKPOINT_CLAIM,
    CHECKPOINT_VOLUME,
    DEFAULT_NAMESPACE,
    ETCD_CLIENT_DIR,
    ETCD_CLIENT_PORT,
    ETCD_METRICS_PORT,
    ETCD_NAME,
    ETCD_PEER_PORT,
    ETCD_PEER_SERVICE,
    ETCD_TLS_DIR,
    ETCD_TLS_SECRET,
    GPU_RESOURCE,
    LAUNCHER_PRIORITY_CLASS,
    NAME_LABEL,
    PART_OF_LABEL,
    PASSWORD_KEY,
    PRIORITY_CLASS,
    ROLE_LABEL,
    ROLE_LAUNCHER,
    ROLE_WORKER,
    TEMPLATE_DIR,
    TEMPLATE_KEY,
    TEMPLATE_PATH,
    TLS_CA,
    TLS_CERT,
    TLS_KEY,
    WORKER_SHAPE_LABEL,
    api_policy_name,
    default_etcd_endpoints,
    etcd_client_secret,
    etcd_labels,
    job_labels,
    launcher_name,
    metrics_policy_name,
    network_policy_name,
    pod_labels,
    same_job,
    template_name,
    worker_service_account,
)

Manifest = dict[str, Any]

# PyYAML ships no type hints; imported this way it is Any without a stub package or an ignore.
yaml: Any = importlib.import_module("yaml")

#: The value of the PriorityClass of preemptible training pods: below the default priority (0),
#: so that other pods preempt training first, and not below the cluster autoscaler's default
#: cut-off for "expendable" pods (-10), so that pending workers still make it add nodes.
PRIORITY_VALUE: Final = -5

#: The value of the launchers' PriorityClass: above the default (0) and the workers' (-5), so
#: that a pending launcher pod (one that replaces another, on a full cluster) preempts a pod of
#: lower priority rather than wait (its job's nodes leave after 60 s without a launcher); far
#: below the system classes (2000000000) and the usual classes of serving workloads (1000000).
LAUNCHER_PRIORITY_VALUE: Final = 1000

#: Pods of the launcher Job that may fail (crash, OOM kill, an operational exit code 3) before
#: the Job fails: each replacement adopts the running job; a launcher that keeps crashing stops
#: after the Job's back-off delays (10 s, 20 s, 40 s) instead of looping. Handovers (exit code 5)
#: and disruptions (drains, evictions, preemption) do not count (LAUNCHER_FAILURE_POLICY).
LAUNCHER_BACKOFF_LIMIT: Final = 3

#: The launcher container's name (the failure policy's rules name it).
LAUNCHER_CONTAINER: Final = "launcher"

#: What the launcher Job does with a pod that failed, first rule that matches wins: a disrupted
#: pod (a DisruptionTarget condition: a drain's eviction, preemption, node-pressure eviction)
#: and a launcher that handed the job over (SIGTERM) are replaced without counting towards
#: backoffLimit; a launcher that ended the job as failed, or was given bad input, fails the Job
#: (another pod cannot change that); anything else (a crash, an OOM kill, etcd or the API out
#: of reach past --outage-timeout) counts.
LAUNCHER_FAILURE_POLICY: Final = (
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    {
        "action": "Ignore",
        "onExitCodes": {
            "containerName": LAUNCHER_CONTAINER,
            "operator": "In",
            "values": [EXIT_HANDED_OVER],
        },
    },
    {
        "action": "FailJob",
        "onExitCodes": {
            "containerName": LAUNCHER_CONTAINER,
            "operator": "In",
            "values": [EXIT_JOB_FAILED, EXIT_BAD_INPUT],
        },
    },
)

#: The launcher's dashboard, /metrics and JSON API port in its pod (``--metrics-port``).
DEFAULT_METRICS_PORT: Final = 9090

#: The image of the namespace's etcd (k8s/base and ``with_etcd``).
ETCD_IMAGE: Final = "gcr.io/etcd-development/etcd:v3.5.21"

#: The worker pods' network interface: the pod network's in every common CNI. Gloo's and, on
#: GPUs, NCCL's sockets use it; left to itself NCCL may take another interface (a secondary
#: network's, an InfiniBand one) that the other pods cannot reach, and hang at its first use.
POD_INTERFACE: Final = "eth0"

#: The user and group the images run as (Dockerfile, Dockerfile.gpu: ``USER 1000:1000``): the
#: fsGroup of the launcher and worker pods, so that the checkpoint claim is writable for them.
IMAGE_GROUP: Final = 1000

#: Seconds a worker pod has between SIGTERM and SIGKILL (scale-down, preemption, drain): the
#: agent's graceful leave takes up to its leave timeout (60 s: ``AgentSettings.leave_timeout``),
#: in which the node's training processes reach their next commit and, when they hold the only
#: copy of it, persist it or hand it to the newcomers (docs/architecture.md); 30 s more for the
#: processes to exit and a last checkpoint write to finish.
WORKER_GRACE_SECONDS: Final = 90

#: The ports the Kubernetes API server is reached on: the Service ``kubernetes`` (443) and the
#: API server's own port behind it (6443 on most clusters), which NetworkPolicies see after NAT.
API_SERVER_PORTS: Final = (443, 6443)

#: Default size of the checkpoint claim (``--checkpoint-size``).
DEFAULT_CHECKPOINT_SIZE: Final = "10Gi"

#: The launcher's writable /tmp (its root filesystem is read-only): the events file
#: (``$TMPDIR/elastic-run/<job>.events.jsonl`` by default) is all it writes there.
LAUNCHER_TMP_LIMIT: Final = "1Gi"

#: The launcher needs no GPU: ``void`` makes the NVIDIA container runtime expose none to it,
#: even where that runtime is the nodes' default and the image asks for all of them (NVIDIA's
#: CUDA images set NVIDIA_VISIBLE_DEVICES=all). Workers get theirs from the device plugin.
LAUNCHER_GPUS: Final = "void"


def shm_size(gpus: int) -> str:
    """The sizeLimit of a worker's memory-backed /dev/shm: 1 GiB per GPU, at least 1 GiB.
    A container's default is 64 MiB; NCCL's shared-memory transport (buffers per pair of local
    processes) and input pipelines need more (NVIDIA runs its deep-learning containers with
    1 GB), and without a limit /dev/shm may grow to the pod's memory limit, or half the node's
    memory where the kubelet does not size it. Its pages count against the memory limit."""
    return f"{max(1, gpus)}Gi"


#: Environment variables the launcher pod gets from the downward API.
POD_ENV: Final = (
    (env.POD_NAME, "metadata.name"),
    (env.POD_UID, "metadata.uid"),
    (env.POD_IP, "status.podIP"),
    (env.NAMESPACE, "metadata.namespace"),
)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Toleration:
    """A pod toleration: ``key`` with ``value`` (operator Equal) or without (Exists)."""

    key: str
    effect: str = "NoSchedule"
    value: str | None = None

    @classmethod
    def parse(cls, text: str) -> Toleration:
        """``KEY[=VALUE][:EFFECT]`` (effect NoSchedule by default); ConfigError if malformed."""
        rest, _, effect = text.partition(":")
        key, has_value, value = rest.partition("=")
        toleration = cls(key, effect or "NoSchedule", value if has_value else None)
        if not _LABEL_KEY.match(key) or effect not in ("", *_EFFECTS):
            raise ConfigError(
                f"invalid --toleration {text!r}: use KEY[=VALUE][:EFFECT] with EFFECT one of "
                f"{', '.join(_EFFECTS)} (for example nvidia.com/gpu:NoSchedule)"
            )
        return toleration

    def manifest(self) -> Manifest:
        result: Manifest = {"key": self.key}
        if self.value is None:
            result["operator"] = "Exists"
        else:
            result["operator"] = "Equal"
            result["value"] = self.value
        result["effect"] = self.effect
        return result


@dataclass(frozen=True)
class JobSpec:
    """What ``elastic-run k8s render`` turns into manifests: the job's options and where and
    how it runs on the cluster; :meth:`validate` checks it."""

    image: str
    job: JobOptions
    namespace: str = DEFAULT_NAMESPACE
    #: The launcher pod's image (default: ``image``); for a GPU job, the CPU image: the
    #: launcher needs no GPU and a GPU image is a pull of several GB on a CPU node.
    launcher_image: str | None = None
    cpu: str = "1"
    memory: str = "2Gi"
    etcd: str | None = None  # default: the namespace's etcd Service
    with_etcd: bool = False
    #: The namespace's etcd (``with_etcd``, and the default endpoints) speaks TLS only.
    etcd_tls: bool = True
    etcd_replicas: int = 3
    priority_class: str | None = PRIORITY_CLASS
    #: The launcher pod's PriorityClass (None: none).
    launcher_priority_class: str | None = LAUNCHER_PRIORITY_CLASS
    #: Also create both PriorityClasses (cluster-scoped).
    with_priority_class: bool = False
    #: A PodDisruptionBudget that keeps voluntary evictions (drains) from the running launcher
    #: until the job ends; off by default: a drain then hands the job over (docs/kubernetes.md).
    launcher_disruption_budget: bool = False
    network_policy: bool = True
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    #: The launcher's metrics port (scraped through the prometheus.io annotations); None: off.
    metrics_port: int | None = DEFAULT_METRICS_PORT
    #: The PersistentVolumeClaim mounted at the job's ``--checkpoint-dir`` (workers; and the
    #: launcher when ``tensorboard_dir`` is set); shared by the namespace's jobs.
    checkpoint_claim: str = CHECKPOINT_CLAIM
    #: Also create that claim (ReadWriteMany, ``checkpoint_size``, ``checkpoint_storage_class``).
    with_checkpoint_claim: bool = False
    checkpoint_size: str = DEFAULT_CHECKPOINT_SIZE
    checkpoint_storage_class: str | None = None
    #: The sizeLimit of each worker's memory-backed /dev/shm (``--shm-size``); None:
    #: :func:`shm_size` of the job's GPUs. The in-memory snapshots need room for two copies
    #: of the state per training process there, NCCL and input pipelines some more.
    shm_limit: str | None = None
    #: The launcher's ``--tensorboard-dir``: a folder inside ``--checkpoint-dir`` (on the claim,
    #: which every worker and then the launcher mount); None: no summaries.
    tensorboard_dir: str | None = None
    #: Also create the cluster's admission policy for launchers (:mod:`launcher.k8s.admission`).
    with_admission_policy: bool = False
    #: The API server's addresses (CIDRs) the launcher may reach on 443/6443; empty: any address.
    api_server_cidrs: tuple[str, ...] = ()

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def launcher_image_or_default(self) -> str:
        """The launcher pod's image: ``launcher_image``, else the workers' ``image``."""
        return self.launcher_image or self.image

    @property
    def etcd_endpoints(self) -> str:
        return self.etcd or default_etcd_endpoints(self.etcd_tls)

    @property
    def client_tls(self) -> bool:
        """Whether the job reaches etcd over TLS, with its client Secret mounted."""
        return self.etcd_endpoints.startswith("https://")

    def validate(self) -> JobSpec:
        """Return self if every field is usable, else raise ConfigError naming the flag."""
        job_options.validate(self.job)
        if not _DNS_LABEL.match(self.namespace):
            raise ConfigError(
                f"invalid --namespace {self.namespace!r}: use at most 63 lowercase letters, "
                "digits and '-', starting and ending with a letter or digit"
            )
        for flag, image in (("--image", self.image), ("--launcher-image", self.launcher_image)):
            if image is not None and (not image or any(ch.isspace() for ch in image)):
                raise ConfigError(
                    f"invalid {flag} {image!r}: give an image reference such as "
                    "registry.example.com/elastic-allreduce:0.1.0"
                )
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ConfigError(
                f"invalid --metrics-port {self.metrics_port}: give a TCP port (1-65535) for the "
                "launcher pod, or --no-metrics"
            )
        self._validate_volumes()
        return self._validate_placement()

    def _validate_volumes(self) -> None:
        checkpoints = self.job.checkpoint_dir
        if checkpoints is not None and not (
            posixpath.isabs(checkpoints) and posixpath.normpath(checkpoints) != "/"
        ):
            raise ConfigError(
                f"invalid --checkpoint-dir {checkpoints!r}: on Kubernetes give an absolute path, "
                "where the worker pods mount the checkpoint claim (for example /checkpoints)"
            )
        if not _DNS_LABEL.match(self.checkpoint_claim):
            raise ConfigError(f"invalid --checkpoint-claim {self.checkpoint_claim!r}")
        if not _QUANTITY.match(self.checkpoint_size):
            raise ConfigError(
                f"invalid --checkpoint-size {self.checkpoint_size!r}: use a Kubernetes quantity "
                "such as 10Gi"
            )
        if self.shm_limit is not None and not _QUANTITY.match(self.shm_limit):
            raise ConfigError(
                f"invalid --shm-size {self.shm_limit!r}: use a Kubernetes quantity such as 4Gi"
            )
        storage_class = self.checkpoint_storage_class
        if storage_class is not None and not _DNS_SUBDOMAIN.match(storage_class):
            raise ConfigError(f"invalid --checkpoint-storage-class {storage_class!r}")
        if self.with_checkpoint_claim and checkpoints is None:
            raise ConfigError(
                "--with-checkpoint-claim creates the claim that --checkpoint-dir is mounted "
                "from: give --checkpoint-dir too (for example /checkpoints)"
            )
        if self.tensorboard_dir is not None:
            _check_tensorboard_dir(self.tensorboard_dir, checkpoints, self.job_id)
        for cidr in self.api_server_cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ConfigError(
                    f"invalid --api-server-cidr {cidr!r}: give the API server's address as a "
                    "CIDR (for example 10.0.0.1/32; `kubectl get endpoints kubernetes` shows it)"
                ) from exc

    def _validate_placement(self) -> JobSpec:
        for flag, quantity in (("--cpu", self.cpu), ("--memory", self.memory)):
            if not _QUANTITY.match(quantity):
                raise ConfigError(
                    f"invalid {flag} {quantity!r}: use a Kubernetes quantity such as 500m, 2, "
                    "512Mi or 4Gi"
                )
        if self.with_etcd and self.etcd is not None:
            raise ConfigError("--with-etcd deploys the namespace's etcd: do not pass --etcd too")
        if self.etcd_replicas not in (1, 3, 5):
            raise ConfigError(
                f"--etcd-replicas must be 1, 3 or 5 (an odd quorum), got {self.etcd_replicas}"
            )
        if self.with_priority_class and self.priority_class != PRIORITY_CLASS:
            raise ConfigError(
                f"--with-priority-class creates {PRIORITY_CLASS!r}; it cannot be combined with "
                f"--priority-class {self.priority_class!r}"
            )
        if self.with_priority_class and self.launcher_priority_class != LAUNCHER_PRIORITY_CLASS:
            raise ConfigError(
                f"--with-priority-class creates {LAUNCHER_PRIORITY_CLASS!r} for the launcher; it "
                f"cannot be combined with --launcher-priority-class "
                f"{self.launcher_priority_class!r}"
            )
        for flag, name in (
            ("--priority-class", self.priority_class),
            ("--launcher-priority-class", self.launcher_priority_class),
        ):
            if name is not None and not _DNS_SUBDOMAIN.match(name):
                raise ConfigError(f"invalid {flag} {name!r}")
        for key, value in self.node_selector.items():
            if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
                raise ConfigError(
                    f"invalid --node-selector {key}={value}: use KEY=VALUE with a label key "
                    "and value (for example cloud.google.com/gke-accelerator=nvidia-l4)"
                )
        return self


def _check_tensorboard_dir(path: str, checkpoints: str | None, job_id: str) -> None:
    """ConfigError unless ``path`` is a folder inside the checkpoint folder (on the claim, which
    the launcher then mounts too) and outside the job's own checkpoint folder."""
    if checkpoints is None or not posixpath.isabs(path):
        raise ConfigError(
            f"invalid --tensorboard-dir {path!r}: on Kubernetes the launcher and every worker "
            "write there, so give a folder inside --checkpoint-dir (on the checkpoint claim, "
            "which they all mount), for example --checkpoint-dir /checkpoints --tensorboard-dir "
            f"/checkpoints/tensorboard/{job_id}"
        )
    folder, root = posixpath.normpath(path), posixpath.normpath(checkpoints)
    own = posixpath.join(root, job_id)
    if posixpath.commonpath([folder, root]) != root or folder == root:
        raise ConfigError(
            f"invalid --tensorboard-dir {path!r}: give a folder inside --checkpoint-dir "
            f"{checkpoints} (the checkpoint claim, mounted by the launcher and every worker), "
            f"for example {root}/tensorboard/{job_id}"
        )
    if posixpath.commonpath([folder, own]) == own:
        raise ConfigError(
            f"invalid --tensorboard-dir {path!r}: {own} holds the job's checkpoints; give "
            f"another folder, for example {root}/tensorboard/{job_id}"
        )


def _pod_security(fs_group: int | None = None) -> Manifest:
    """A pod's security context: non-root, the runtime's default seccomp profile and, with
    ``fs_group``, volumes made writable for that group (only where their owner differs)."""
    context: Manifest = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if fs_group is not None:
        context.update(fsGroup=fs_group, fsGroupChangePolicy="OnRootMismatch")
    return context


def _container_security(*, read_only_root: bool = False) -> Manifest:
    context: Manifest = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if read_only_root:
        context["readOnlyRootFilesystem"] = True
    return context


def _checkpoint_volume(spec: JobSpec) -> Manifest:
    return {
        "name": CHECKPOINT_VOLUME,
        "persistentVolumeClaim": {"claimName": spec.checkpoint_claim},
    }


def _checkpoint_mount(spec: JobSpec) -> Manifest:
    return {"name": CHECKPOINT_VOLUME, "mountPath": str(spec.job.checkpoint_dir)}


#: The etcd client settings of a job's pods, as files of the job's client Secret.
_CLIENT_FILES: Final = (
    ("--etcd-cacert", env.ETCD_CACERT, f"{ETCD_CLIENT_DIR}/{TLS_CA}"),
    ("--etcd-cert", env.ETCD_CERT, f"{ETCD_CLIENT_DIR}/{TLS_CERT}"),
    ("--etcd-key", env.ETCD_KEY, f"{ETCD_CLIENT_DIR}/{TLS_KEY}"),
    ("--etcd-password-file", env.ETCD_PASSWORD_FILE, f"{ETCD_CLIENT_DIR}/{PASSWORD_KEY}"),
)


def _client_volume(spec: JobSpec) -> Manifest:
    return {"name": "etcd-client", "secret": {"secretName": etcd_client_secret(spec.job_id)}}


def _client_mount() -> Manifest:
    return {"name": "etcd-client", "mountPath": ETCD_CLIENT_DIR, "readOnly": True}


def _client_flags(spec: JobSpec) -> list[str]:
    """The launcher's etcd TLS and auth flags (none for a plain etcd)."""
    if not spec.client_tls:
        return []
    flags = [part for flag, _, path in _CLIENT_FILES for part in (flag, path)]
    return [*flags, "--etcd-user", spec.job_id]


def worker_pod(spec: JobSpec) -> Manifest:
    """The worker pod template: the provisioner adds the name, the etcd, job, node and host
    variables, and creates one such pod per worker node."""
    gpus = spec.job.gpus_per_node
    limits: dict[str, str | int] = {"memory": spec.memory}
    variables = [{"name": env.GLOO_IFACE, "value": POD_INTERFACE}]
    if gpus:
        limits[GPU_RESOURCE] = gpus
        # NCCL's sockets on the pod network; TensorFlow takes GPU memory as it needs it, so
        # that NCCL can re-create its communicators after every elastic reset. No
        # NVIDIA_VISIBLE_DEVICES: the device plugin sets it to the pod's GPUs.
        variables += [
            {"name": env.NCCL_SOCKET_IFNAME, "value": POD_INTERFACE},
            {"name": env.TF_FORCE_GPU_ALLOW_GROWTH, "value": "true"},
        ]
    # NCCL and TensorFlow need more shared memory than a container's default 64 MiB.
    mounts: list[Manifest] = [{"name": "dshm", "mountPath": "/dev/shm"}]  # noqa: S108
    volumes: list[Manifest] = [
        {
            "name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_limit or shm_size(gpus)},
        }
    ]
    if spec.client_tls:
        variables += [{"name": name, "value": path} for _, name, path in _CLIENT_FILES]
        variables.append({"name": env.ETCD_USER, "value": spec.job_id})
        mounts.append(_client_mount())
        volumes.append(_client_volume(spec))
    if spec.job.checkpoint_dir is not None:
        mounts.append(_checkpoint_mount(spec))
        volumes.append(_checkpoint_volume(spec))
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        # SIGTERM: the agent leaves the ring at the next commit (up to 60 s), see the constant.
        "terminationGracePeriodSeconds": WORKER_GRACE_SECONDS,
        # A service account without rights, and no token: the admission policy requires both.
        "serviceAccountName": worker_service_account(spec.job_id),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(IMAGE_GROUP),
        "containers": [
            {
                "name": "worker",
                "image": spec.image,
                # The training command is the pod's own, not config/job's: nobody who can
                # write the job's keys can change what a worker runs.
                "command": ["elastic-run", "join"],
                "args": ["--", *spec.job.command],
                "env": variables,
                "resources": {
                    "requests": {"cpu": spec.cpu, "memory": spec.memory},
                    "limits": limits,
                },
                "securityContext": _container_security(),
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if spec.priority_class is not None:
        pod_spec["priorityClassName"] = spec.priority_class
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    tolerations = list(spec.tolerations)
    if gpus and not any(t.key == GPU_RESOURCE for t in tolerations):
        # GPU node pools are commonly tainted nvidia.com/gpu:NoSchedule; harmless where not.
        tolerations.append(Toleration(GPU_RESOURCE))
    if tolerations:
        pod_spec["tolerations"] = [t.manifest() for t in tolerations]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": pod_labels(spec.job_id, ROLE_WORKER)},
        "spec": pod_spec,
    }


def launcher_args(spec: JobSpec) -> list[str]:
    """Arguments of ``elastic-run`` in the launcher pod (Kubernetes expands ``$(VAR)``): Kubernetes
    mode, then every job flag (:func:`launcher.job_options.to_args`) and the command."""
    return [
        "run",
        "--kubernetes",
        "--worker-template",
        TEMPLATE_PATH,
        "--namespace",
        f"$({env.NAMESPACE})",
        "--etcd",
        spec.etcd_endpoints,
        *_client_flags(spec),
        *([] if spec.metrics_port is None else ["--metrics-port", str(spec.metrics_port)]),
        *([] if spec.tensorboard_dir is None else ["--tensorboard-dir", spec.tensorboard_dir]),
        *job_options.to_args(spec.job),
    ]


def _launcher_job(spec: JobSpec) -> Manifest:
    name = launcher_name(spec.job_id)
    mounts: list[Manifest] = [
        {"name": "worker-template", "mountPath": TEMPLATE_DIR, "readOnly": True},
        # The root filesystem is read-only: /tmp (the events file) is an emptyDir.
        {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108
    ]
    volumes: list[Manifest] = [
        {"name": "worker-template", "configMap": {"name": template_name(spec.job_id)}},
        {"name": "tmp", "emptyDir": {"sizeLimit": LAUNCHER_TMP_LIMIT}},
    ]
    if spec.client_tls:
        mounts.append(_client_mount())
        volumes.append(_client_volume(spec))
    if spec.tensorboard_dir is not None:
        # The launcher's TensorBoard summaries go to <dir>/launcher, on the checkpoint claim.
        mounts.append(_checkpoint_mount(spec))
        volumes.append(_checkpoint_volume(spec))
    pod_metadata: Manifest = {"labels": pod_labels(spec.job_id, ROLE_LAUNCHER)}
    container: Manifest = {}
    if spec.metrics_port is not None:
        # The usual annotations of a Prometheus pod scrape (kubernetes_sd_configs role: pod).
        pod_metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(spec.metrics_port),
            "prometheus.io/path": "/metrics",
        }
        container["ports"] = [{"name": "metrics", "containerPort": spec.metrics_port}]
    pod_spec: Manifest = {
        "serviceAccountName": name,
        # A pod failure policy needs Never; the Job makes a new pod (a new name and uid)
        # for every failure, which adopts the job.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 90,
        "enableServiceLinks": False,
    }
    if spec.launcher_priority_class is not None:
        pod_spec["priorityClassName"] = spec.launcher_priority_class
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": job_labels(spec.job_id)},
        "spec": {
            # A new launcher pod adopts the running job (docs/kubernetes.md, "The launcher pod").
            "backoffLimit": LAUNCHER_BACKOFF_LIMIT,
            "podFailurePolicy": {"rules": copy.deepcopy(list(LAUNCHER_FAILURE_POLICY))},
            # A replacement starts once the pod before has ended (handed over, or its lease
            # gone), never beside it (the only value allowed with a pod failure policy).
            "podReplacementPolicy": "Failed",
            "template": {
                "metadata": pod_metadata,
                "spec": {
                    **pod_spec,
                    "securityContext": _pod_security(IMAGE_GROUP),
                    "containers": [
                        {
                            "name": LAUNCHER_CONTAINER,
                            "image": spec.launcher_image_or_default,
                            "command": ["elastic-run"],
                            "args": launcher_args(spec),
                            "env": [
                                *(
                                    {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                                    for name, path in POD_ENV
                                ),
                                {"name": env.NVIDIA_VISIBLE_DEVICES, "value": LAUNCHER_GPUS},
                            ],
                            "resources": {
                                "requests": {"cpu": "250m", "memory": "512Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            **container,
                            "securityContext": _container_security(read_only_root=True),
                            "volumeMounts": mounts,
                        }
                    ],
                    "volumes": volumes,
                },
            },
        },
    }


def _rbac(spec: JobSpec) -> list[Manifest]:
    name = launcher_name(spec.job_id)
    labels = job_labels(spec.job_id)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "labels": labels},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "labels": labels},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    # patch: the ring annotation on the launcher's own pod.
                    "verbs": ["create", "delete", "get", "list", "patch", "watch"],
                },
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
        },
        {
            # The workers' identity: no Role binds it, and no pod mounts its token.
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": worker_service_account(spec.job_id), "labels": labels},
            "automountServiceAccountToken": False,
        },
    ]


def worker_shape(spec: JobSpec) -> dict[str, str]:
    """The job's worker shape: what the cluster's admission policy lets its launcher create
    (:func:`launcher.k8s.admission.worker_shape`), as the worker pod template has it."""
    return admission.worker_shape(
        job_id=spec.job_id,
        images=(spec.image,),
        launcher_account=launcher_name(spec.job_id),
        worker_account=worker_service_account(spec.job_id),
        secrets=(etcd_client_secret(spec.job_id),) if spec.client_tls else (),
        claims=(spec.checkpoint_claim,) if spec.job.checkpoint_dir is not None else (),
    )


def _template_config_map(spec: JobSpec) -> Manifest:
    """The worker pod template, and beside it the job's worker shape, which the admission
    policy's binding takes as its parameters (by the worker-shape label)."""
    text = yaml.safe_dump(worker_pod(spec), sort_keys=False, default_flow_style=False)
    labels = {**job_labels(spec.job_id), WORKER_SHAPE_LABEL: admission.SHAPE_LABEL_VALUE}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": template_name(spec.job_id), "labels": labels},
        "data": {TEMPLATE_KEY: text, **worker_shape(spec)},
    }


def _network_policies(spec: JobSpec) -> list[Manifest]:
    labels = job_labels(spec.job_id)
    job_pods = {"podSelector": {"matchLabels": same_job(spec.job_id)}}
    dns_ports = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    return [
        {
            # Workers reach the launcher's rendezvous and each other (Gloo, NCCL) on random
            # ports; everything else is closed in both directions except etcd and DNS.
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": network_policy_name(spec.job_id), "labels": labels},
            "spec": {
                "podSelector": {"matchLabels": same_job(spec.job_id)},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": [job_pods]}],
                "egress": [
                    {"to": [job_pods]},
                    {
                        "to": [{"podSelector": {"matchLabels": etcd_labels()}}],
                        "ports": [{"protocol": "TCP", "port": ETCD_CLIENT_PORT}],
                    },
                    {"ports": dns_ports},
                ],
            },
        },
        {
            # The launcher talks to the Kubernetes API, whose address depends on the cluster:
            # any address on its ports, unless the API server's addresses are given.
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": api_policy_name(spec.job_id), "labels": labels},
            "spec": {
                "podSelector": {
                    "matchLabels": {**same_job(spec.job_id), ROLE_LABEL: ROLE_LAUNCHER}
                },
                "policyTypes": ["Egress"],
                "egress": [_api_server_rule(spec)],
            },
        },
        *_metrics_policy(spec),
    ]


def _api_server_rule(spec: JobSpec) -> Manifest:
    rule: Manifest = {}
    if spec.api_server_cidrs:
        rule["to"] = [{"ipBlock": {"cidr": cidr}} for cidr in spec.api_server_cidrs]
    rule["ports"] = [{"protocol": "TCP", "port": port} for port in API_SERVER_PORTS]
    return rule


def _metrics_policy(spec: JobSpec) -> list[Manifest]:
    """Scrapers (Prometheus, in any namespace) reach the launcher's metrics port, and only it."""
    if spec.metrics_port is None:
        return []
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": metrics_policy_name(spec.job_id),
                "labels": job_labels(spec.job_id),
            },
            "spec": {
                "podSelector": {
                    "matchLabels": {**same_job(spec.job_id), ROLE_LABEL: ROLE_LAUNCHER}
                },
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"protocol": "TCP", "port": spec.metrics_port}]}],
            },
        }
    ]


def checkpoint_claim(
    name: str = CHECKPOINT_CLAIM,
    size: str = DEFAULT_CHECKPOINT_SIZE,
    storage_class: str | None = None,
) -> Manifest:
    """A namespace's checkpoint claim: ReadWriteMany, because the worker pods of a job run on
    several nodes and all mount it (with ReadWriteOnce only pods on one node could); a storage
    class that offers it is a network file system (NFS, CephFS, a cloud's file store). It has
    no job label: every job of the namespace uses it, in its own folder, and deleting a job
    keeps it (and its checkpoints)."""
    spec: Manifest = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": size}},
    }
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": {PART_OF_LABEL: APP_NAME}},
        "spec": spec,
    }


def launcher_disruption_budget(spec: JobSpec) -> Manifest:
    """The launcher's PodDisruptionBudget (``--launcher-pdb``): no voluntary eviction of a
    running launcher, so a drain of its node waits until the job ends or someone deletes the
    launcher pod (a handover). A launcher pod that is not Ready (starting, failing) can always
    be evicted. An integer minAvailable is the only budget the disruption controller computes
    for a Job's pod (maxUnavailable needs a controller with a scale: it would fail safe)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": launcher_name(spec.job_id), "labels": job_labels(spec.job_id)},
        "spec": {
            "minAvailable": 1,
            "selector": {"matchLabels": pod_labels(spec.job_id, ROLE_LAUNCHER)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def priority_classes() -> list[Manifest]:
    """The cluster-scoped PriorityClasses: preemptible workers, then launchers."""
    return [priority_class(), launcher_priority_class()]


def launcher_priority_class() -> Manifest:
    """The cluster-scoped PriorityClass of launcher pods: above the default and the workers'."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": LAUNCHER_PRIORITY_CLASS, "labels": {NAME_LABEL: APP_NAME}},
        "value": LAUNCHER_PRIORITY_VALUE,
        "globalDefault": False,
        # A launcher that replaces another on a full cluster takes a lower-priority pod's place
        # (at worst one of the job's own workers, which the job survives) instead of waiting.
        "preemptionPolicy": "PreemptLowerPriority",
        "description": "Elastic training launchers: one small pod per job, placed before "
        "workers and default-priority pods.",
    }


def priority_class() -> Manifest:
    """The cluster-scoped PriorityClass of preemptible training pods."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": PRIORITY_CLASS, "labels": {NAME_LABEL: APP_NAME}},
        "value": PRIORITY_VALUE,
        "globalDefault": False,
        # Training never evicts other pods to get a node; other pods may evict training pods,
        # which leave the ring gracefully (SIGTERM) and the job continues with fewer workers.
        "preemptionPolicy": "Never",
        "description": "Elastic training workers: preemptible, they never preempt others.",
    }


def _etcd_tls_settings() -> dict[str, str]:
    """etcd's TLS for clients and peers, each side requiring a certificate signed by the CA."""
    files = {"CERT_FILE": TLS_CERT, "KEY_FILE": TLS_KEY, "TRUSTED_CA_FILE": TLS_CA}
    settings = {}
    for side in ("ETCD_", "ETCD_PEER_"):
        settings.update({side + name: f"{ETCD_TLS_DIR}/{key}" for name, key in files.items()})
        settings[side + "CLIENT_CERT_AUTH"] = "true"
    # The readiness probe has no certificate: /health (and /metrics) on a plain port of its own.
    settings["ETCD_LISTEN_METRICS_URLS"] = f"http://0.0.0.0:{ETCD_METRICS_PORT}"
    return settings


def etcd(replicas: int = 3, image: str = ETCD_IMAGE, *, tls: bool = True) -> list[Manifest]:
    """A namespace's etcd: headless peer Service, client Service, StatefulSet, NetworkPolicy.
    With ``tls`` clients and peers speak TLS only and need certificates signed by the CA of the
    Secret ``elastic-allreduce-etcd-tls``, whose server certificate the members use."""
    scheme = "https" if tls else "http"
    peers = ",".join(
        f"{ETCD_NAME}-{i}={scheme}://{ETCD_NAME}-{i}.{ETCD_PEER_SERVICE}.$(POD_NAMESPACE).svc:"
        f"{ETCD_PEER_PORT}"
        for i in range(replicas)
    )
    own = f"$(POD_NAME).{ETCD_PEER_SERVICE}.$(POD_NAMESPACE).svc"
    settings = {
        "ETCD_NAME": "$(POD_NAME)",
        "ETCD_DATA_DIR": "/var/lib/etcd/data",
        "ETCD_LISTEN_CLIENT_URLS": f"{scheme}://0.0.0.0:{ETCD_CLIENT_PORT}",
        "ETCD_LISTEN_PEER_URLS": f"{scheme}://0.0.0.0:{ETCD_PEER_PORT}",
        "ETCD_ADVERTISE_CLIENT_URLS": f"{scheme}://{own}:{ETCD_CLIENT_PORT}",
        "ETCD_INITIAL_ADVERTISE_PEER_URLS": f"{scheme}://{own}:{ETCD_PEER_PORT}",
        "ETCD_INITIAL_CLUSTER": peers,
        "ETCD_INITIAL_CLUSTER_STATE": "new",
        "ETCD_INITIAL_CLUSTER_TOKEN": ETCD_NAME,
        "ETCD_AUTO_COMPACTION_MODE": "periodic",
        "ETCD_AUTO_COMPACTION_RETENTION": "1h",
        **(_etcd_tls_settings() if tls else {}),
    }
    container_ports: list[Manifest] = [
        {"name": "client", "containerPort": ETCD_CLIENT_PORT},
        {"name": "peer", "containerPort": ETCD_PEER_PORT},
    ]
    mounts: list[Manifest] = [{"name": "data", "mountPath": "/var/lib/etcd"}]
    volumes: list[Manifest] = []
    if tls:
        container_ports.append({"name": "metrics", "containerPort": ETCD_METRICS_PORT})
        mounts.append({"name": "tls", "mountPath": ETCD_TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": ETCD_TLS_SECRET}})
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            **_pod_security(),
            "runAsUser": 65534,
            "runAsGroup": 65534,
            "fsGroup": 65534,
        },
        "containers": [
            {
                "name": "etcd",
                "image": image,
                "command": ["/usr/local/bin/etcd"],
                "env": [
                    {
                        "name": "POD_NAME",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                    },
                    {
                        "name": "POD_NAMESPACE",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                    },
                    *({"name": k, "value": v} for k, v in settings.items()),
                ],
                "ports": container_ports,
                "readinessProbe": {
                    "httpGet": {"path": "/health", "port": "metrics" if tls else "client"},
                    "periodSeconds": 5,
                    "failureThreshold": 3,
                },
                "resources": {
                    "requests": {"cpu": "100m", "memory": "256Mi"},
                    "limits": {"memory": "512Mi"},
                },
                "securityContext": _container_security(read_only_root=True),
                "volumeMounts": mounts,
            }
        ],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    ports = [
        {"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client"},
        {"name": "peer", "port": ETCD_PEER_PORT, "targetPort": "peer"},
    ]
    labels = etcd_labels()
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ETCD_PEER_SERVICE, "labels": labels},
            "spec": {
                "clusterIP": "None",
                # Members must find each other by DNS before any of them is ready (quorum).
                "publishNotReadyAddresses": True,
                "selector": labels,
                "ports": ports,
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ETCD_NAME, "labels": labels},
            "spec": {"selector": labels, "ports": ports[:1]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": ETCD_NAME, "labels": labels},
            "spec": {
                "serviceName": ETCD_PEER_SERVICE,
                "replicas": replicas,
                # All members start together: none can become ready without a quorum.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
                "volumeClaimTemplates": [
                    {
                        "metadata": {"name": "data"},
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": "1Gi"}},
                        },
                    }
                ],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": ETCD_NAME, "labels": labels},
            "spec": {
                "podSelector": {"matchLabels": labels},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {NAME_LABEL: APP_NAME}}}],
                        "ports": [{"protocol": "TCP", "port": ETCD_CLIENT_PORT}],
                    },
                    {
                        "from": [{"podSelector": {"matchLabels": labels}}],
                        "ports": [
                            {"protocol": "TCP", "port": ETCD_CLIENT_PORT},
                            {"protocol": "TCP", "port": ETCD_PEER_PORT},
                        ],
                    },
                ],
            },
        },
    ]


def render(spec: JobSpec) -> list[Manifest]:
    """Every object of the job described by ``spec`` (validated first), in apply order.
    Namespaced objects carry ``metadata.namespace``."""
    spec.validate()
    cluster: list[Manifest] = priority_classes() if spec.with_priority_class else []
    if spec.with_admission_policy:
        cluster += admission.objects()
    namespaced: list[Manifest] = (
        etcd(spec.etcd_replicas, tls=spec.etcd_tls) if spec.with_etcd else []
    )
    if spec.with_checkpoint_claim:
        namespaced.append(
            checkpoint_claim(
                spec.checkpoint_claim, spec.checkpoint_size, spec.checkpoint_storage_class
            )
        )
    namespaced += _rbac(spec)
    namespaced.append(_template_config_map(spec))
    if spec.network_policy:
        namespaced += _network_policies(spec)
    if spec.launcher_disruption_budget:
        namespaced.append(launcher_disruption_budget(spec))
    namespaced.append(_launcher_job(spec))
    for manifest in namespaced:
        manifest["metadata"]["namespace"] = spec.namespace
    return cluster + namespaced


def to_yaml(manifests: Sequence[Manifest]) -> str:
    """A multi-document YAML stream, as ``kubectl apply -f -`` reads it."""
    return "---\n".join(yaml.safe_dump(m, sort_keys=False) for m in manifests)
