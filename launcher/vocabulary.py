"""The control plane's shared vocabulary: what the leader sees, what it decides, what it tells
observers, and what every node of a job is started with.

The leader (:mod:`launcher.leader`) and the node agent (:mod:`launcher.node`) both speak it and
never import each other; observers (:mod:`launcher.observe`, :mod:`launcher.k8s.events`) and
provisioners need no more than this module. Plain frozen dataclasses and enums: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic_allreduce.records import keys
from elastic_allreduce.records.values import (
    DEFAULT_KEEP_CHECKPOINTS,
    EpochCause,
    ExitRecord,
    Ring,
    ScriptError,
)
from elastic_allreduce.rendezvous.model import SlotAssignment
from elastic_allreduce.rendezvous.protocol import WaitKind


@dataclass(frozen=True)
class Proc:
    """A live training process (its ``procs/<slot>`` key exists, under its node's lease)."""

    slot: str
    incarnation: int
    registered: int
    #: The script ended successfully; the process is shutting down (its lease may lapse first).
    finished: bool = False


@dataclass(frozen=True)
class Member:
    """A live node (its agent's ``members/<node>`` key exists under the agent's lease)."""

    node: str
    slots: int
    leaving: bool
    registered: int
    #: The members this node's probes cannot reach (see launcher.node.probes).
    unreachable: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Exit:
    """A process exit reported by its agent at ``exits/<slot>/<incarnation>``."""

    slot: str
    incarnation: int
    code: int | None
    signal: int | None
    tail: tuple[str, ...] = ()
    #: The error its script ended with (an exception, sys.exit), when its bootstrap said.
    error: ScriptError | None = None

    @property
    def succeeded(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        return ExitRecord(self.code, self.signal).describe()


class Phase(enum.Enum):
    """Where the job is."""

    RUNNING = "running"
    FINISHING = "finishing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# -- decisions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteRing:
    """Write this ring epoch (compare-and-swap on the previous one)."""

    ring: Ring


@dataclass(frozen=True)
class ReleaseWaiters:
    """Answer waiting slots: their ranks in ``epoch`` (REMOVED for slots not admitted)."""

    epoch: int
    answers: tuple[tuple[str, SlotAssignment], ...]


@dataclass(frozen=True)
class NotifyWorkers:
    """Send Horovod host-update notifications so members reset at their next commit.

    Always of the "hosts added" kind: Horovod skips the state sync after a reset that was only
    announced as a removal, but a later epoch may add a newcomer before a member has reset, and
    a member that skipped the sync then waits forever for a newcomer that is syncing.
    """

    slots: tuple[str, ...]
    timestamp: int


@dataclass(frozen=True)
class SetDirective:
    """Tell a node's agent which incarnation each of its slots should run (absent: stop it)."""

    node: str
    incarnations: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StartNodes:
    """Ask the provisioner for more nodes."""

    count: int


@dataclass(frozen=True)
class StopNode:
    """Ask the provisioner to stop a node gracefully (scale-down)."""

    node: str


@dataclass(frozen=True)
class FinishJob:
    """The job is over."""

    succeeded: bool
    reason: str


@dataclass(frozen=True)
class Log:
    """A membership change or decision worth a line in the launcher's log."""

    message: str


class ChangeKind(enum.Enum):
    """What happened to the ring's membership (the reason of a Kubernetes Event)."""

    JOINED = "Joined"
    LEFT = "Left"
    CRASHED = "Crashed"
    REFORMED = "Reformed"
    #: No process holding the newest commit survived: the ring restarted from an older one
    #: (launcher.leader.state_loss; ``slots`` empty).
    STATE_LOST = "StateLost"
    #: A process could not write a checkpoint and skipped it (``slots``: that process).
    CHECKPOINT_SKIPPED = "CheckpointSkipped"
    #: A rank holds the ring back: its share of each step is far above the others'
    #: (launcher.leader.stragglers; ``slots``: that rank).
    STRAGGLER = "Straggler"


@dataclass(frozen=True)
class MembershipChange:
    """A membership change for observers (Kubernetes Events); ``slots`` in rank order for
    REFORMED, else the slots concerned (empty for a node lost before it had processes)."""

    kind: ChangeKind
    epoch: int
    slots: tuple[str, ...]
    message: str
    #: REFORMED: why the epoch was formed, and seconds from its decision to every member
    #: released (the re-form time observers chart).
    cause: EpochCause | None = None
    duration: float | None = None


Decision = (
    WriteRing
    | ReleaseWaiters
    | NotifyWorkers
    | SetDirective
    | StartNodes
    | StopNode
    | FinishJob
    | Log
    | MembershipChange
)


@dataclass(frozen=True)
class JobView:
    """Everything the policy looks at, read at one moment."""

    now: float
    procs: Mapping[str, Proc]
    members: Mapping[str, Member]
    exits: tuple[Exit, ...]
    waiting: Mapping[str, WaitKind]
    #: Nodes asked for with ``elastic-run scale`` (None: no request).
    scale_target: int | None = None
    #: Requested nodes that the cluster cannot place yet (Kubernetes: unschedulable pods).
    pending_nodes: frozenset[str] = frozenset()
    #: Nodes lost without being asked to stop, and why (Kubernetes: a pod that failed, was
    #: evicted, preempted or deleted by someone else). Cumulative; the policy handles each once.
    disrupted_nodes: Mapping[str, str] = field(default_factory=dict)
    #: Nodes whose processes are known gone (Kubernetes: a Failed pod) while their leases in
    #: the store have not expired yet: their slots are not waited for.
    dead_nodes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NodeTemplate:
    """What every worker node of a job is started with (the launcher's provisioner, or
    ``elastic-run join``, adds the node's id: :meth:`for_node`)."""

    etcd: str
    job_id: str
    nproc_per_node: int
    command: tuple[str, ...]
    checkpoint_dir: str | None = None
    #: Where the training processes run (None: the agent's working directory).
    workdir: str | None = None
    #: The address peers reach the node at.
    host: str = "127.0.0.1"
    gloo_iface: str = "lo"
    #: TTL of the node's lease and of each training process's (the job's --lease-ttl).
    lease_ttl: int = 3
    leave_timeout: float = 60.0
    start_timeout: float = 60.0
    #: The job's --tensorboard-dir (None: no summaries).
    tensorboard_dir: str | None = None
    #: The job's --keep-checkpoints.
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS

    def for_node(self, node_id: str) -> AgentSettings:
        """The settings of one node of this template."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(NodeTemplate)}
        return AgentSettings(**fields, node_id=keys.validate_node_id(node_id))


@dataclass(frozen=True, kw_only=True)
class AgentSettings(NodeTemplate):
    """What one agent needs: its job's node template and its own node id."""

    node_id: str
    #: Started by the launcher (it may replace a lost node whose member key has not expired
    #: yet): the --max-workers check of a node that joins by itself is skipped.
    provisioned: bool = False
