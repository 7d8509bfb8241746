"""The launcher's decisions, as a pure state machine over snapshots of the job.

:class:`RingPolicy.step` takes a :class:`JobView` (what the store and the rendezvous say now)
and returns the decisions to execute, in order (both defined in :mod:`launcher.vocabulary`). It does
no I/O, so every rule is unit-tested step by step; :mod:`launcher.leader.job` executes the
decisions.

Each node the policy knows is in one :class:`NodeState`, moved only along NODE_TRANSITIONS;
every restart is spent through one :class:`RestartBudget`; the wanted number of nodes changes
in one place (``RingPolicy._set_target``), with its reason.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Mapping, Set
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from elastic_allreduce.errors import ElasticAllreduceError
from elastic_allreduce.records.keys import slot_id, split_slot
from elastic_allreduce.records.values import (
    NOT_ADMITTED_EXIT_CODE,
    STATE_MISMATCH_EXIT_CODE,
    EpochCause,
    JobSettings,
    Ring,
    RingState,
    ScriptError,
)
from elastic_allreduce.rendezvous.model import REMOVED, next_membership
from elastic_allreduce.rendezvous.protocol import WaitKind
from launcher.vocabulary import (
    ChangeKind,
    Decision,
    Exit,
    FinishJob,
    JobView,
    Log,
    Member,
    MembershipChange,
    NotifyWorkers,
    Phase,
    ReleaseWaiters,
    SetDirective,
    StartNodes,
    StopNode,
    WriteRing,
)

#: Seconds a requested node may take to register before it counts as failed to start.
NODE_START_TIMEOUT = 120.0


@dataclass(frozen=True)
class _Adoption:
    """A takeover waiting for the adopted ring's members to register again (RingPolicy.adopt)."""

    ring: Ring
    directives: Mapping[str, Mapping[int, int]]
    #: When it stops waiting: whatever is still missing then is handled as lost.
    until: float


def missing_at_takeover(ring: Ring | None, view: JobView) -> tuple[str, ...]:
    """What a takeover waits for: the nodes and processes of ``ring`` absent from the view
    (their leases expired), except slots whose exit was reported. Sorted."""
    if ring is None:
        return ()
    exited = {exit_.slot for exit_ in view.exits}
    nodes = {split_slot(slot)[0] for slot in ring.slots} - view.members.keys()
    slots = {slot for slot in ring.slots if slot not in view.procs and slot not in exited}
    return tuple(sorted(f"node {n}" for n in nodes)) + tuple(
        sorted(f"slot {s}" for s in slots if split_slot(s)[0] not in nodes)
    )


def _proc_incarnation(view: JobView, slot: str) -> int | None:
    proc = view.procs.get(slot)
    return None if proc is None else proc.incarnation


class PolicyError(ElasticAllreduceError):
    """The policy was asked to do something its rules forbid (a bug in its caller or in it)."""


#: Seconds beyond the lease TTL that a slot's lost lease waits for its node's lease to go too
#: (leases granted at different moments expire up to one keep-alive interval apart).
LOST_LEASE_GRACE: Final = 1.0

#: Epochs that ran whose members the policy remembers to tell a bug in the script (every
#: member failing alike) from a crash of one process.
EPOCHS_REMEMBERED: Final = 16
#: Lines of a script's traceback quoted when its bug fails the job.
SCRIPT_ERROR_LINES: Final = 6


@dataclass(frozen=True)
class LostLease:
    """A process record gone with no exit report (its node's lease), waiting to be settled."""

    incarnation: int
    #: When it was seen lost (the view's clock).
    since: float
    #: What happened, as logged.
    problem: str
    #: Whether the process was a member of the ring then (a ring moves on without it).
    ring_member: bool


def parked_nodes(members: Mapping[str, Member], holders: Set[str]) -> frozenset[str]:
    """The nodes to leave out of the ring so that every pair of the others reaches each other.

    A pair is cut when each side's probes fail to reach the other: a report from one side only
    means the other is dead or cut off from etcd too (its record can no longer change), which its
    leases handle; parking on it could leave out the survivor of a crash. Nodes are kept greedily:
    first the holders of the newest commit, then the nodes in fewest cut pairs (so a node cut
    off from many goes, not the many), then the nodes with more ranks, then the earliest
    registered; a node is kept when it is cut from none of those kept before it.
    """
    cut = {
        frozenset((node, peer))
        for node, member in members.items()
        for peer in member.unreachable
        if peer in members and peer != node and node in members[peer].unreachable
    }
    if not cut:
        return frozenset()
    involved = {node for pair in cut for node in pair}
    cuts = collections.Counter(node for pair in cut for node in pair)
    order = sorted(
        involved,
        key=lambda n: (n not in holders, cuts[n], -members[n].slots, members[n].registered),
    )
    kept: list[str] = []
    for node in order:
        if all(frozenset((node, other)) not in cut for other in kept):
            kept.append(node)
    return frozenset(involved - set(kept))


# -- nodes --------------------------------------------------------------------------------------


class NodeState(enum.Enum):
    """Where a node is in its life, as far as the policy knows (moves: NODE_TRANSITIONS)."""

    #: Never heard of: not started by us, not seen registered, not reported (never stored).
    UNKNOWN = "unknown"
    #: Asked of the provisioner; its agent has not registered yet (counts toward the target).
    REQUESTED = "requested"
    #: Requested but not registered within NODE_START_TIMEOUT: stopped (a pod placed but never
    #: started, an agent that cannot reach etcd), no longer counted, and replaced while restarts
    #: last; if it registers after all (the stop raced its start), it is let go.
    TIMED_OUT = "timed out"
    #: Its agent's ``members/<node>`` key appeared: a node of the job.
    REGISTERED = "registered"
    #: Its agent leaves gracefully on its own (SIGTERM): the target was lowered for it.
    LEAVING = "leaving"
    #: We asked the provisioner to stop it (scale-down): nothing about it counts any more.
    STOPPING = "stopping"
    #: Its member key vanished without a graceful leave: replaced or the target lowered, once.
    LOST = "lost"
    #: The provisioner reported it lost (failed, evicted, preempted): replaced or the target
    #: lowered, once; a graceful leave it made first no longer lowers the target.
    DISRUPTED = "disrupted"


#: The moves a node may make; any other is a bug and raises PolicyError. A LOST or LEAVING node
#: whose member key comes back live (its id reused by ``elastic-run join``) counts as live again,
#: so it may still leave or be stopped; a LOST node that joined by itself and registers again
#: (its agent was cut off from etcd, fenced itself and came back) is REGISTERED again;
#: TIMED_OUT, STOPPING and DISRUPTED are final.
NODE_TRANSITIONS: Final[Mapping[NodeState, frozenset[NodeState]]] = MappingProxyType(
    {
        NodeState.UNKNOWN: frozenset(
            {NodeState.REQUESTED, NodeState.REGISTERED, NodeState.LEAVING, NodeState.DISRUPTED}
        ),
        NodeState.REQUESTED: frozenset(
            {NodeState.REGISTERED, NodeState.LEAVING, NodeState.TIMED_OUT, NodeState.DISRUPTED}
        ),
        NodeState.TIMED_OUT: frozenset(),
        NodeState.REGISTERED: frozenset(
            {NodeState.LEAVING, NodeState.STOPPING, NodeState.LOST, NodeState.DISRUPTED}
        ),
        NodeState.LEAVING: frozenset({NodeState.STOPPING, NodeState.DISRUPTED}),
        NodeState.LOST: frozenset(
            {NodeState.REGISTERED, NodeState.LEAVING, NodeState.STOPPING, NodeState.DISRUPTED}
        ),
        NodeState.STOPPING: frozenset(),
        NodeState.DISRUPTED: frozenset(),
    }
)

#: Nodes whose agent we have not seen register: their member key appearing is news.
_UNREGISTERED: Final = frozenset({NodeState.UNKNOWN, NodeState.REQUESTED})
#: Members that no longer count toward the target even while their key exists.
_DISCOUNTED: Final = frozenset({NodeState.STOPPING, NodeState.DISRUPTED, NodeState.TIMED_OUT})


@dataclass(frozen=True)
class _NodeEntry:
    state: NodeState
    #: When the node entered its state (for REQUESTED: when the start timeout began).
    since: float


class NodeTable:
    """Every node the policy has heard of, each in one explicit :class:`NodeState`.

    :meth:`move` is the only way a node changes state, and it enforces NODE_TRANSITIONS.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _NodeEntry] = {}

    def state(self, node: str) -> NodeState:
        """The node's state (UNKNOWN for a node never heard of)."""
        entry = self._entries.get(node)
        return NodeState.UNKNOWN if entry is None else entry.state

    def since(self, node: str) -> float:
        """When the node entered its state (or its clock was restarted)."""
        entry = self._entries.get(node)
        if entry is None:
            raise PolicyError(f"node {node} is unknown to the policy: it has no state to date")
        return entry.since

    def in_state(self, state: NodeState) -> list[str]:
        """The nodes in ``state``, in the order the policy first heard of them."""
        return [node for node, entry in self._entries.items() if entry.state is state]

    def count(self, state: NodeState) -> int:
        """How many nodes are in ``state``."""
        return sum(1 for entry in self._entries.values() if entry.state is state)

    def move(self, node: str, to: NodeState, now: float) -> NodeState:
        """Move ``node`` to ``to`` at ``now``; return the state it left.

        Raises PolicyError for a move NODE_TRANSITIONS does not allow (the state is unchanged).
        """
        source = self.state(node)
        if to not in NODE_TRANSITIONS[source]:
            allowed = ", ".join(sorted(s.value for s in NODE_TRANSITIONS[source])) or "none"
            raise PolicyError(
                f"node {node} cannot go from {source.value} to {to.value} "
                f"(allowed from {source.value}: {allowed})"
            )
        self._entries[node] = _NodeEntry(to, now)
        return source

    def restart_clock(self, node: str, now: float) -> None:
        """Date the node's current state from ``now`` (a requested node the cluster cannot
        place yet: its start timeout runs from when it is placed)."""
        entry = self._entries.get(node)
        if entry is None:
            raise PolicyError(f"node {node} is unknown to the policy: it has no clock to restart")
        self._entries[node] = _NodeEntry(entry.state, now)


@dataclass
class RestartBudget:
    """The job's restarts (``--max-restarts``): every crash restart and every replacement of a
    hung process or lost node spends one, through :meth:`try_spend`."""

    limit: int
    used: int = 0

    def __post_init__(self) -> None:
        if self.limit < 0 or not 0 <= self.used <= self.limit:
            raise PolicyError(
                f"a restart budget needs 0 <= used <= limit, got used={self.used} "
                f"limit={self.limit} (--max-restarts must be 0 or more)"
            )

    @property
    def left(self) -> int:
        """Restarts that may still be spent."""
        return self.limit - self.used

    def try_spend(self) -> bool:
        """Spend one restart if any is left; False (nothing spent) when the budget is used up."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True


class RingPolicy:
    """The launcher's state machine: one :meth:`step` per change of the view.

    Nodes live in :attr:`nodes` (one :class:`NodeState` each), restarts in :attr:`budget`;
    the wanted number of nodes changes only in :meth:`_set_target`.
    """

    def __init__(
        self, settings: JobSettings, rendezvous: str, started_at: float, target_workers: int
    ) -> None:
        self.settings = settings
        self.rendezvous = rendezvous
        self.started_at = started_at
        #: When the first worker node of the first ring was ready: the start grace counts from
        #: then, not from the job's start (TensorFlow's import alone can outlast it).
        self.first_ready_at: float | None = None
        self._target_workers = target_workers
        self._target_reason = "the job's initial size"
        self.budget = RestartBudget(settings.max_restarts)
        self.nodes = NodeTable()
        self.ring: Ring | None = None
        self.phase = Phase.RUNNING
        self.epoch_since = 0.0
        #: The last crash that cost the job a slot (reported if the job later fails).
        self.failure: str | None = None
        #: A crash of a member while the others were finishing: the job fails with it.
        self.finish_failure: str | None = None
        self.below_min_since: float | None = None
        self.handled_exits: set[tuple[str, int]] = set()
        self.finished: set[str] = set()
        self.abandoned: set[str] = set()
        self.killed_stuck: set[tuple[str, int]] = set()
        self.directives: dict[str, dict[int, int]] = {}
        #: The process incarnation of each member of the current ring.
        self.member_incarnations: dict[str, int] = {}
        #: Last incarnation seen alive per slot (to tell a lost lease from a reported exit).
        self.incarnations: dict[str, int] = {}
        self.scale_request: int | None = None
        #: Slots whose script ended successfully, with the incarnation that did.
        self.finishing: dict[str, int] = {}
        #: Slots of the last epoch that ran: they hold the committed state (after its sync).
        self.holders: set[str] = set()
        #: Nodes that joined by themselves (``elastic-run join``): lost, they are not replaced
        #: (nothing here can start them) but rejoin when they can (see _track_nodes).
        self.joined: set[str] = set()
        #: Slots whose lease was lost with no exit report while their node was still a
        #: member. Charged to the budget only if the node stays a member for LOST_LEASE_GRACE
        #: beyond the lease TTL (see _settle_lost_leases).
        self.lost_pending: dict[str, LostLease] = {}
        #: Nodes left out of the ring because they and a peer cannot reach each other.
        self.parked: frozenset[str] = frozenset()
        #: A takeover held back until the adopted ring's nodes and processes register again
        #: (see :meth:`adopt`); None once the job is adopted.
        self._adopting: _Adoption | None = None
        #: The member processes (slot, incarnation) of the last EPOCHS_REMEMBERED epochs that
        #: ran, and the errors scripts ended with: a bug in the script is told from a crash
        #: of one process by them (see _script_bug).
        self.epoch_members: dict[int, frozenset[tuple[str, int]]] = {}
        self.script_errors: dict[tuple[str, int], ScriptError] = {}
        #: The resize epoch whose lone member's missed commit was logged (see
        #: _watch_for_stuck_members).
        self._alone_told: int | None = None

    @property
    def target_workers(self) -> int:
        """The number of nodes the job wants now."""
        return self._target_workers

    @property
    def target_reason(self) -> str:
        """Why :attr:`target_workers` last changed."""
        return self._target_reason

    @property
    def restarts_used(self) -> int:
        """Restarts spent so far (of ``settings.max_restarts``)."""
        return self.budget.used

    def node_state(self, node: str) -> NodeState:
        """Where ``node`` is in its life (UNKNOWN for a node never heard of)."""
        return self.nodes.state(node)

    # -- the step ----------------------------------------------------------------------------

    def step(self, view: JobView) -> list[Decision]:
        """The decisions for this view, in the order they must be executed."""
        if self.phase in (Phase.SUCCEEDED, Phase.FAILED):
            return self._reject_all_waiters(view)
        decisions: list[Decision] = []
        if self._adopting is not None:
            pending = self._adopting
            if view.now < pending.until and missing_at_takeover(pending.ring, view):
                return []
            self._adopting = None
            decisions += self._adopt(pending.ring, view, pending.directives)
        for exit_ in view.exits:
            decisions += self._on_exit(exit_, view)
        decisions += self._on_lost_leases(view)
        decisions += self._update_parked(view)
        for proc in view.procs.values():
            if proc.finished:
                self.finishing[proc.slot] = proc.incarnation
        if self.phase is Phase.FINISHING:
            decisions += self._reject_all_waiters(view)
            decisions += self._maybe_finish(view)
            return decisions
        decisions += self._plan_membership(view)
        decisions += self._maybe_start_epoch(view)
        decisions += self._watch_for_stuck_members(view)
        decisions += self._provision(view)
        return decisions

    def nodes_started(self, nodes: list[str], now: float) -> None:
        """The provisioner started these nodes (called by the executor of StartNodes)."""
        for node in nodes:
            # An id the policy already knows (`elastic-run join --node-id` took it first): its
            # agent cannot register under a taken id, so there is nothing new to wait for.
            if self.nodes.state(node) is NodeState.UNKNOWN:
                self.nodes.move(node, NodeState.REQUESTED, now)

    def adopt(
        self,
        ring: Ring | None,
        view: JobView,
        directives: Mapping[str, Mapping[int, int]],
        hold: float = 0.0,
    ) -> list[Decision]:
        """Take over a running job whose launcher is gone, from what the store holds: its
        ring (kept as it is: no new epoch, no rollback), its members (as nodes that joined by
        themselves, until :meth:`manage` names those the provisioner manages) and the
        directives they follow. The restarts spent go on from the ring's count.

        Right after an etcd outage every lease has expired: the ring's nodes and processes
        are missing from the view until they register again. For up to ``hold`` seconds the
        takeover waits for them (:func:`missing_at_takeover`; :meth:`step` decides nothing
        meanwhile), so that they are not taken for dead: no node started, none stopped.
        """
        missing = missing_at_takeover(ring, view)
        if ring is not None and missing and hold > 0:
            self._adopting = _Adoption(ring, directives, view.now + hold)
            return [
                Log(
                    f"took over ring epoch {ring.epoch}, but {', '.join(missing)} "
                    "not registered (their leases expired while etcd was away?): waiting up to "
                    f"{hold:.0f} s for them to register again"
                )
            ]
        return self._adopt(ring, view, directives)

    def manage(self, nodes: Set[str]) -> None:
        """The provisioner manages these adopted nodes (it started them under an earlier
        launcher of the job): lost, they are replaced like nodes this launcher started, and a
        straggler among them may be evicted. Until then every adopted node counts as one that
        joined by itself."""
        self.joined -= nodes

    @property
    def adopting(self) -> bool:
        """Whether a takeover still waits for the adopted ring's members (see :meth:`adopt`)."""
        return self._adopting is not None

    @property
    def awaited_nodes(self) -> frozenset[str]:
        """The nodes of the adopted ring while a takeover waits for them: the launcher counts
        them as members meanwhile (a node whose lease lapsed in the outage asks whether it
        still counts before it registers again; told no, it would stop its processes)."""
        if self._adopting is None:
            return frozenset()
        return frozenset(split_slot(slot)[0] for slot in self._adopting.ring.slots)

    def _adopt(
        self, ring: Ring | None, view: JobView, directives: Mapping[str, Mapping[int, int]]
    ) -> list[Decision]:
        self.started_at = self.first_ready_at = view.now - self.settings.start_grace
        for node in view.members:
            self.nodes.move(node, NodeState.REGISTERED, view.now)
            self.joined.add(node)
        live = sum(1 for m in view.members.values() if not m.leaving)
        wanted = view.scale_target if view.scale_target is not None else live
        self.scale_request = view.scale_target
        # Up to --min-workers only for a launcher that starts nodes itself: with --workers 0
        # nodes join by `elastic-run join`, and this one starts none of its own accord.
        least = min(self.settings.min_workers, self.target_workers)
        self._set_target(
            max(least, min(self.settings.max_workers, wanted)),
            "the members of the job this launcher took over",
        )
        self.directives = {node: dict(slots) for node, slots in directives.items()}
        for member in view.members.values():
            if member.node not in self.directives:
                self.directives[member.node] = {
                    index: proc.incarnation if proc is not None else 1
                    for index in range(member.slots)
                    for proc in [view.procs.get(slot_id(member.node, index))]
                }
        self.incarnations = {slot: proc.incarnation for slot, proc in view.procs.items()}
        for exit_ in view.exits:
            # Handled by the launcher before: it already asked for a later incarnation.
            node, index = split_slot(exit_.slot)
            if self.directives.get(node, {}).get(index, 0) > exit_.incarnation:
                self.handled_exits.add((exit_.slot, exit_.incarnation))
        if ring is None:
            return [Log("took over a job that had not formed its first ring yet")]
        self.budget.used = min(ring.restarts_used, self.budget.limit)
        self.ring = ring
        # The ring's own record of its members where it has one: a process registered since
        # (an agent fenced itself in an outage and restarted it) is a newcomer, not a member.
        self.member_incarnations = {
            slot: incarnation
            for slot in ring.slots
            if (incarnation := ring.incarnation(slot) or _proc_incarnation(view, slot))
        }
        self.epoch_since = view.now
        if ring.state is RingState.RUNNING:
            self.holders = set(ring.slots)
        return [
            Log(
                f"took over ring epoch {ring.epoch} ({ring.state.value}, {len(ring.slots)} "
                f"ranks) and {len(view.members)} nodes; the ranks go on training"
            )
        ]

    def _set_target(self, workers: int, reason: str) -> None:
        """The one place the wanted number of nodes changes, and why (see target_reason)."""
        self._target_workers = workers
        self._target_reason = reason

    # -- lost leases ---------------------------------------------------------------------------

    def _on_lost_leases(self, view: JobView) -> list[Decision]:
        """Slots whose process record vanished with no exit report: its node's lease expired
        (the node hung or was cut off, or etcd let it expire in an outage)."""
        decisions: list[Decision] = []
        for slot, incarnation in list(self.incarnations.items()):
            if slot in view.procs and view.procs[slot].incarnation == incarnation:
                continue
            del self.incarnations[slot]
            if (slot, incarnation) in self.handled_exits:
                continue
            node, _ = split_slot(slot)
            member = view.members.get(node)
            if member is not None and member.leaving:
                # Its node leaves gracefully: the process was told to go, and its agent's exit
                # report (which may come seconds later on a loaded machine) says how it went.
                continue
            self.handled_exits.add((slot, incarnation))
            if self.finishing.get(slot) == incarnation:
                # The script had ended well: a slow interpreter exit, not a hang.
                self.finished.add(slot)
                if self.phase is Phase.RUNNING:
                    self.phase = Phase.FINISHING
                decisions.append(Log(f"slot {slot} finished training (its process is exiting)"))
                continue
            problem = f"slot {slot} lost its lease (hung or unreachable)"
            if self.ring is not None and slot in self.ring.slots:
                decisions.append(
                    MembershipChange(ChangeKind.CRASHED, self.ring.epoch, (slot,), problem)
                )
            decisions.append(Log(problem))
            if member is not None and not member.leaving and self.phase is Phase.RUNNING:
                # A node cut off from etcd loses every lease, its own a moment later: wait to
                # see which, so that a network failure is not charged as crashes.
                ring_member = self.member_incarnations.get(slot) == incarnation
                self.lost_pending[slot] = LostLease(incarnation, view.now, problem, ring_member)
        for slot, proc in view.procs.items():
            self.incarnations[slot] = proc.incarnation
        return decisions + self._settle_lost_leases(view)

    def _settle_lost_leases(self, view: JobView) -> list[Decision]:
        """Decide the pending lost leases: free when the slot's node was lost as well (a
        partition or a dead node: the node rejoins, or is replaced, as a whole); a restart
        from the budget once the node has stayed a member past the lease TTL and
        LOST_LEASE_GRACE (the process hung, or only it was cut off)."""
        decisions: list[Decision] = []
        settle_after = self.settings.lease_ttl + LOST_LEASE_GRACE
        for slot, lost in list(self.lost_pending.items()):
            incarnation, since, problem = lost.incarnation, lost.since, lost.problem
            node, index = split_slot(slot)
            member = view.members.get(node)
            proc = view.procs.get(slot)
            if not lost.ring_member and proc is not None and proc.incarnation == incarnation:
                # The process registered again under a new lease (its keep-alive came too
                # late, on a loaded machine or a slow etcd): it lives, and it was in no ring
                # that moved on without it, so it goes on to the barrier.
                del self.lost_pending[slot]
                self.handled_exits.discard((slot, incarnation))
                decisions.append(
                    Log(f"slot {slot}: its process registered again; no restart needed")
                )
                continue
            if member is None or member.leaving or self.phase is not Phase.RUNNING:
                del self.lost_pending[slot]
                if member is None:
                    decisions.append(
                        Log(f"slot {slot}: its node {node} was lost too; no restart charged")
                    )
                continue
            if view.now - since <= settle_after:
                continue
            del self.lost_pending[slot]
            if self.budget.try_spend():
                decisions += [
                    Log(f"{problem}; replacing it (restart {self.budget.used})"),
                    self._set_slot(member, index, incarnation + 1),
                ]
            else:
                self.failure = problem
                self.abandoned.add(slot)
                decisions += [
                    Log(f"{problem}; no restarts left, dropping the slot"),
                    self._set_slot(member, index, None),
                ]
        return decisions

    # -- nodes ---------------------------------------------------------------------------------

    def _provision(self, view: JobView) -> list[Decision]:
        """Keep the number of nodes at the target: scale requests, leaves, lost nodes."""
        decisions: list[Decision] = []
        settings = self.settings
        # Members we neither started nor saw before (`elastic-run join`): taken before this
        # step moves any node.
        arrivals = sorted(
            n
            for n in view.members
            if self.nodes.state(n) is NodeState.UNKNOWN
            or (n in self.joined and self.nodes.state(n) is NodeState.LOST)
        )
        if view.scale_target is not None and view.scale_target != self.scale_request:
            self.scale_request = view.scale_target
            wanted = max(settings.min_workers, min(settings.max_workers, view.scale_target))
            decisions.append(Log(f"scaling to {wanted} nodes (asked for {view.scale_target})"))
            self._set_target(wanted, f"`elastic-run scale` asked for {view.scale_target} nodes")
        decisions += self._on_disruptions(view)
        decisions += self._on_leaves(view)
        decisions += self._track_nodes(view, arrivals)
        if self.phase is not Phase.RUNNING:
            return decisions
        alive = sorted(
            (
                m
                for m in view.members.values()
                if not m.leaving and self.nodes.state(m.node) not in _DISCOUNTED
            ),
            key=lambda m: m.registered,
        )
        have = len(alive) + self.nodes.count(NodeState.REQUESTED)
        if have < self.target_workers:
            decisions.append(StartNodes(self.target_workers - have))
        elif have > self.target_workers and self.ring is not None:
            for member in alive[max(0, len(alive) - (have - self.target_workers)) :]:
                self.nodes.move(member.node, NodeState.STOPPING, view.now)
                decisions.append(StopNode(member.node))
        return decisions

    def _on_disruptions(self, view: JobView) -> list[Decision]:
        """Nodes the provisioner reports lost (failed, evicted, preempted, deleted by someone
        else): replaced while restarts last, even when the node's agent left gracefully (the
        SIGTERM of a preemption is not a request to shrink the job)."""
        decisions: list[Decision] = []
        for node, reason in sorted(view.disrupted_nodes.items()):
            if self.nodes.state(node) in (NodeState.DISRUPTED, NodeState.STOPPING):
                continue
            previous = self.nodes.move(node, NodeState.DISRUPTED, view.now)
            if previous is NodeState.LOST:
                # Its lease expired before the cluster reported the pod (real kubelets lag):
                # the loss was handled then (and charged once); nothing more to do.
                decisions.append(Log(f"node {node} was lost: {reason} (handled at its lease loss)"))
                continue
            if previous is NodeState.LEAVING:
                self._set_target(
                    self.target_workers + 1, f"node {node} was lost, not leaving: {reason}"
                )
            epoch = self.ring.epoch if self.ring else 0
            known = {*view.procs, *(self.ring.slots if self.ring else ())}
            slots = tuple(sorted(s for s in known if split_slot(s)[0] == node))
            if self.phase is not Phase.RUNNING:
                decisions.append(Log(f"node {node} was lost: {reason}"))
                continue
            if self.budget.try_spend():
                message = f"node {node} was lost: {reason}; starting a replacement"
            else:
                self._set_target(
                    self.target_workers - 1, f"node {node} was lost with no restarts left"
                )
                self.failure = self.failure or f"node {node} was lost: {reason}"
                message = f"node {node} was lost: {reason}; no restarts left to replace it"
            decisions += [
                Log(message),
                MembershipChange(ChangeKind.CRASHED, epoch, slots, message),
            ]
        return decisions

    def _on_leaves(self, view: JobView) -> list[Decision]:
        """Nodes whose agent leaves gracefully on its own: the job shrinks by one for each (a
        node we are stopping, or one the provisioner reported lost, changes nothing)."""
        decisions: list[Decision] = []
        for member in view.members.values():
            state = self.nodes.state(member.node)
            if not member.leaving or state in (NodeState.LEAVING, *_DISCOUNTED):
                continue
            self.nodes.move(member.node, NodeState.LEAVING, view.now)
            self._set_target(self.target_workers - 1, f"node {member.node} left gracefully")
            decisions.append(Log(f"node {member.node} is leaving gracefully"))
        return decisions

    def _on_arrivals(self, view: JobView, arrivals: list[str]) -> list[Decision]:
        """Nodes that registered by themselves, or came back after they were lost."""
        decisions: list[Decision] = []
        for node in arrivals:
            # Not started by us: `elastic-run join` asks for one more node, within the maximum.
            back = node in self.joined
            self.joined.add(node)
            if self.target_workers < self.settings.max_workers:
                how = "is back" if back else "joined by itself"
                self._set_target(self.target_workers + 1, f"node {node} {how}")
                decisions.append(Log(f"node {node} {how}; the job now wants {self.target_workers}"))
            if back:
                self.nodes.move(node, NodeState.REGISTERED, view.now)
        return decisions

    def _track_nodes(self, view: JobView, arrivals: list[str]) -> list[Decision]:
        """Note registered, late and lost nodes (a lost node is replaced while restarts last)."""
        decisions = self._on_arrivals(view, arrivals)
        for node in view.members:
            if self.nodes.state(node) in _UNREGISTERED:
                self.nodes.move(node, NodeState.REGISTERED, view.now)
        for node in self.nodes.in_state(NodeState.REQUESTED):
            if node in view.pending_nodes:
                # The start timeout runs from when the cluster places the node, not while it waits.
                self.nodes.restart_clock(node, view.now)
            elif view.now - self.nodes.since(node) > NODE_START_TIMEOUT:
                # Stopped, not forgotten: it would hold its machine (or pod), and a replacement
                # would be asked for at every timeout while each stuck one stays.
                self.nodes.move(node, NodeState.TIMED_OUT, view.now)
                decisions.append(StopNode(node))
                late = f"node {node} did not register within {NODE_START_TIMEOUT:.0f} s"
                if self.budget.try_spend():
                    decisions.append(Log(f"{late}; stopping it and starting another"))
                else:
                    self._set_target(self.target_workers - 1, f"{late}, with no restarts left")
                    decisions.append(Log(f"{late}; stopping it (no restarts left to replace it)"))
        gone = sorted(n for n in self.nodes.in_state(NodeState.REGISTERED) if n not in view.members)
        for node in gone:
            self.nodes.move(node, NodeState.LOST, view.now)
            if self.phase is not Phase.RUNNING:
                continue
            if node in self.joined:
                # Nothing here can start it again; its agent rejoins when it reaches etcd.
                self._set_target(self.target_workers - 1, f"node {node} was lost")
                decisions.append(
                    Log(f"node {node} was lost (dead or cut off); it rejoins by itself if it can")
                )
            elif self.budget.try_spend():
                decisions.append(Log(f"node {node} was lost; starting a replacement"))
            else:
                self._set_target(
                    self.target_workers - 1, f"node {node} was lost with no restarts left"
                )
                decisions.append(Log(f"node {node} was lost; no restarts left to replace it"))
        return decisions

    # -- exits -------------------------------------------------------------------------------

    def _on_exit(self, exit_: Exit, view: JobView) -> list[Decision]:
        pending = self.lost_pending.get(exit_.slot)
        if pending is None or pending.incarnation != exit_.incarnation:
            return self._handle_exit(exit_, view)
        # Its lease was seen gone before its agent's exit report (a slow agent, a loaded
        # machine): the report says what happened. The crash was counted with the lost lease.
        del self.lost_pending[exit_.slot]
        self.handled_exits.discard((exit_.slot, exit_.incarnation))
        return [d for d in self._handle_exit(exit_, view) if not isinstance(d, MembershipChange)]

    def _handle_exit(self, exit_: Exit, view: JobView) -> list[Decision]:  # noqa: PLR0911
        key = (exit_.slot, exit_.incarnation)
        if key in self.handled_exits:
            return []
        self.handled_exits.add(key)
        node, index = split_slot(exit_.slot)
        member = view.members.get(node)
        if exit_.succeeded:
            self.finished.add(exit_.slot)
            if self.phase is Phase.RUNNING:
                self.phase = Phase.FINISHING
            return [Log(f"slot {exit_.slot} finished training (exit code 0)")]
        if (member is not None and member.leaving) or exit_.code == NOT_ADMITTED_EXIT_CODE:
            return [Log(f"slot {exit_.slot} left ({exit_.describe()})")]
        tail = ("; last output: " + " | ".join(exit_.tail[-3:])) if exit_.tail else ""
        problem = f"slot {exit_.slot} crashed: {exit_.describe()}{tail}"
        crashed = MembershipChange(
            ChangeKind.CRASHED,
            self.ring.epoch if self.ring else 0,
            (exit_.slot,),
            f"slot {exit_.slot} crashed: {exit_.describe()}",
        )
        if self.phase is Phase.FINISHING:
            self.finish_failure = self.finish_failure or problem
            return [Log(problem), crashed]
        if key in self.killed_stuck:
            # Its directive already asks for the next incarnation; this is not the user's crash.
            return [Log(f"slot {exit_.slot} was killed because it was stuck; replacing it")]
        if exit_.code == STATE_MISMATCH_EXIT_CODE:
            # The ranks hold different models: a restart would meet the same mismatch.
            self.failure = problem
            return [
                Log(f"{problem}; failing the job"),
                crashed,
                *self._finish(False, problem, view),
            ]
        bug = None if exit_.error is None else self._script_bug(exit_, exit_.error)
        if bug is not None and exit_.error is not None:
            # Every rank would meet it again: no restart, no wait for --wait-timeout.
            error = exit_.error
            last = " | ".join(error.lines[-SCRIPT_ERROR_LINES:])
            reason = f"{bug}: {error.describe()} -- a bug in the script, not retried"
            self.failure = f"{reason}; its last lines: {last}" if last else reason
            return [
                Log(f"{problem}; {bug}: failing the job"),
                crashed,
                *self._finish(False, self.failure, view),
            ]
        if member is not None and self.budget.try_spend():
            return [
                Log(f"{problem}; restarting it ({self.budget.used}/{self.budget.limit})"),
                crashed,
                self._set_slot(member, index, exit_.incarnation + 1),
            ]
        self.failure = problem
        self.abandoned.add(exit_.slot)
        decisions: list[Decision] = [
            Log(f"{problem}; no restarts left, dropping the slot"),
            crashed,
        ]
        if member is not None:
            decisions.append(self._set_slot(member, index, None))
        return decisions

    def _script_bug(self, exit_: Exit, error: ScriptError) -> str | None:
        """Whether this error is a bug in the script -- what, in words -- or None (a crash of
        this process alone: restarted as usual). Two processes fail "the same way" when their
        errors have the same type and message. A bug:

        - every member of a ring epoch of two or more ranks ended with it (in that epoch or a
          later one: a rank whose collective failed first re-forms and meets it again); or
        - a restarted process ended with it before it trained a step (no step and no commit
          reported), as its predecessor in the slot did: a ring of one, or a rank whose error
          the others do not reach before the ring re-forms.
        """
        key = (exit_.slot, exit_.incarnation)
        self.script_errors[key] = error
        before = self.script_errors.get((exit_.slot, exit_.incarnation - 1))
        if before is not None and before.signature == error.signature and not error.trained:
            return (
                f"slot {exit_.slot}'s restarted process (incarnation {exit_.incarnation}) "
                "failed again as its predecessor did, before it trained a step"
            )
        for epoch in sorted(self.epoch_members, reverse=True):
            members = self.epoch_members[epoch]
            if key not in members or len(members) < 2:
                continue
            if all(
                (seen := self.script_errors.get(member)) is not None
                and seen.signature == error.signature
                for member in members
            ):
                return f"every rank of ring epoch {epoch} ({len(members)} ranks) failed alike"
        return None

    def _remember_epoch(self, ring: Ring) -> None:
        """Note the member processes of an epoch that starts running (for _script_bug)."""
        self.epoch_members[ring.epoch] = frozenset(
            (slot, self.member_incarnations.get(slot, 0)) for slot in ring.slots
        )
        for epoch in sorted(self.epoch_members)[:-EPOCHS_REMEMBERED]:
            del self.epoch_members[epoch]

    # -- the hang watchdog's findings (launcher.leader.watchdog) ---------------------------------

    def replace_hung(self, slots: tuple[str, ...], view: JobView) -> list[Decision]:
        """Kill and restart these members of the running ring (they hung); their exits are not
        charged to the restart budget, like a stuck member's."""
        decisions: list[Decision] = []
        for slot in slots:
            decisions += self._replace_stuck(slot, view, f"slot {slot} hung; replacing it")
        return decisions

    def _replace_stuck(self, slot: str, view: JobView, why: str) -> list[Decision]:
        """Kill ``slot``'s member process and start the next incarnation (no budget used);
        nothing for a slot without a live member process, or one already being replaced."""
        proc = view.procs.get(slot)
        node, index = split_slot(slot)
        member = view.members.get(node)
        if proc is None or member is None or (slot, proc.incarnation) in self.killed_stuck:
            return []
        if proc.incarnation != self.member_incarnations.get(slot):
            return []  # a replacement still starting, not the member that got stuck
        self.killed_stuck.add((slot, proc.incarnation))
        return [Log(why), self._set_slot(member, index, proc.incarnation + 1)]

    def evict(self, slot: str, reason: str, view: JobView) -> list[Decision]:
        """Stop the node of a straggler (``--straggler-policy evict``) and start another in its
        place: the target stays, so the next step asks for a node. The stopped node leaves
        gracefully (its agent gets SIGTERM): the ring shrinks at its next commit, nothing rolls
        back, and no restart is spent (not the user's failure)."""
        node, _ = split_slot(slot)
        if self.phase is not Phase.RUNNING or self.nodes.state(node) is not NodeState.REGISTERED:
            return [Log(f"not evicting slot {slot}: node {node} is not a running member")]
        if node in self.joined:
            return [
                Log(
                    f"not evicting slot {slot}: node {node} joined by itself (elastic-run "
                    "join), and this launcher can neither stop nor replace it"
                )
            ]
        self.nodes.move(node, NodeState.STOPPING, view.now)
        return [
            Log(f"evicting node {node} ({reason}); starting another in its place"),
            StopNode(node),
        ]

    def fail(self, reason: str, view: JobView) -> list[Decision]:
        """End the job as failed now (a second hang at the same place)."""
        if self.phase in (Phase.SUCCEEDED, Phase.FAILED):
            return []
        self.failure = reason
        return self._finish(False, reason, view)

    def _set_slot(self, member: Member, index: int, incarnation: int | None) -> SetDirective:
        """Directive for a node with one slot changed (None: stop it)."""
        slots = self.directives.setdefault(member.node, {i: 1 for i in range(member.slots)})
        if incarnation is None:
            slots.pop(index, None)
        else:
            slots[index] = incarnation
        return SetDirective(member.node, tuple(sorted(slots.items())))

    # -- peers that cannot reach each other --------------------------------------------------

    def _update_parked(self, view: JobView) -> list[Decision]:
        """Leave out of the ring the nodes that cannot reach a peer (parked_nodes chooses
        which side), replacing their ring members without charging the budget: the new
        processes wait at the barrier until the probes show every pair reaches each other."""
        holders = {split_slot(slot)[0] for slot in self.holders}
        parked = parked_nodes(view.members, holders)
        decisions: list[Decision] = []
        for node in sorted(parked - self.parked):
            member = view.members[node]
            peers = sorted(
                {
                    *member.unreachable,
                    *(n for n, m in view.members.items() if node in m.unreachable),
                }
                & view.members.keys()
            )
            decisions.append(
                Log(
                    f"node {node} and {', '.join(peers)} cannot reach each other (their probes "
                    f"fail): leaving {node} out of the ring until they can"
                )
            )
            for slot in self.ring.slots if self.ring is not None else ():
                if split_slot(slot)[0] == node:
                    decisions += self._replace_stuck(
                        slot, view, f"slot {slot} leaves the ring: its node cannot reach a peer"
                    )
        for node in sorted(self.parked - parked):
            if node in view.members:
                decisions.append(Log(f"node {node} reaches every peer again; it may rejoin"))
        self.parked = parked
        return decisions

    # -- membership --------------------------------------------------------------------------

    def _usable(self, slot: str, view: JobView) -> bool:
        node = split_slot(slot)[0]
        member = view.members.get(node)
        return (
            member is not None
            and node not in self.parked
            and node not in view.dead_nodes
            and not member.leaving
            and slot not in self.abandoned
            and slot not in self.finished
        )

    def _survivors(self, view: JobView) -> tuple[str, ...]:
        """Ring members still alive as the same process (a restarted slot is a newcomer)."""
        if self.ring is None:
            return ()
        return tuple(
            slot
            for slot in self.ring.slots
            if slot in view.procs
            and view.procs[slot].incarnation == self.member_incarnations.get(slot)
            # An exit reported before its process's record went is no survivor either.
            and (slot, view.procs[slot].incarnation) not in self.handled_exits
            and self._usable(slot, view)
        )

    def _left(self, slot: str, view: JobView) -> bool:
        """A ring member whose node is leaving gracefully while its process still runs."""
        member = view.members.get(split_slot(slot)[0])
        proc = view.procs.get(slot)
        return (
            member is not None
            and member.leaving
            and proc is not None
            and proc.incarnation == self.member_incarnations.get(slot)
        )

    def _alive_nodes(self, view: JobView) -> set[str]:
        """Nodes with at least one usable live process (ready or still starting)."""
        return {split_slot(s)[0] for s in view.procs if self._usable(s, view)}

    def _plan_membership(self, view: JobView) -> list[Decision]:
        ring = self.ring
        survivors = self._survivors(view)
        if ring is not None and not set(survivors) & self.holders:
            # Every holder of the committed state is leaving: they stay in the ring until a
            # newcomer has synced it from them (an epoch has run with both), or it is lost.
            keep = tuple(s for s in ring.slots if s in self.holders and self._left(s, view))
            survivors = keep + tuple(s for s in survivors if s not in keep)
        candidates = {s: view.procs[s].registered for s in survivors}
        for slot, kind in view.waiting.items():
            proc = view.procs.get(slot)
            if (
                kind == WaitKind.FRESH
                and proc is not None
                and (slot, proc.incarnation) not in self.handled_exits  # a dead one's request
                and self._usable(slot, view)
            ):
                candidates.setdefault(slot, proc.registered)
        target = next_membership(survivors, candidates)
        if ring is None:
            per_node = collections.Counter(split_slot(s)[0] for s in target)
            complete = {n for n, count in per_node.items() if count == self.settings.nproc_per_node}
            if complete and self.first_ready_at is None:
                self.first_ready_at = view.now
            grace_over = (
                self.first_ready_at is not None
                and view.now - self.first_ready_at >= self.settings.start_grace
            )
            # Nodes the cluster cannot place yet are not waited for: they join when they start.
            expected = self.target_workers - sum(
                1 for n in view.pending_nodes if self.nodes.state(n) is NodeState.REQUESTED
            )
            enough = len(complete) >= max(expected, self.settings.min_workers)
            if not enough and not (grace_over and len(complete) >= self.settings.min_workers):
                return self._check_min_wait(view, len(complete))
            return self._form(
                view, tuple(s for s in target if split_slot(s)[0] in complete), EpochCause.START
            )
        died = [s for s in ring.slots if s not in survivors and not self._left(s, view)]
        resets = [s for s in ring.slots if view.waiting.get(s) == WaitKind.RESET]
        if ring.state is RingState.RUNNING and not died and not resets and target == ring.slots:
            self.below_min_since = None
            return []
        if ring.state is RingState.FORMING and not died and target == ring.slots:
            return []
        # A member of a forming epoch that died is re-formed for even when the same slots come
        # back: its restarted process must not be admitted to the epoch formed for its
        # predecessor (killed at once, a ring's exits are seen one by one).
        nodes = {split_slot(s)[0] for s in target}
        if len(nodes) < self.settings.min_workers:
            return self._check_min_wait(view, len(nodes))
        self.below_min_since = None
        if ring.state is RingState.FORMING:
            failed = died or ring.cause is EpochCause.FAILURE
            cause = EpochCause.FAILURE if failed else ring.cause
        else:
            cause = EpochCause.FAILURE if (died or resets) else EpochCause.RESIZE
        return self._form(view, target, cause)

    def _starting_nodes(self, view: JobView) -> set[str]:
        """Nodes that may still bring a process: requested and placed but not registered yet
        (for at most NODE_START_TIMEOUT), or registered with no process record yet (their agent
        is starting it). A loaded machine can take longer than the start grace for either."""
        with_procs = {split_slot(s)[0] for s in view.procs}
        placed = {
            n for n in self.nodes.in_state(NodeState.REQUESTED) if n not in view.pending_nodes
        }
        starting = {
            node
            for node in view.members
            if node not in with_procs
            and self.nodes.state(node) not in _DISCOUNTED
            and any(
                self._usable(f"{node}.{index}", view)
                for index in range(self.settings.nproc_per_node)
            )
        }
        return placed | starting

    def _check_min_wait(self, view: JobView, ready: int) -> list[Decision]:
        """Wait while enough processes are alive or nodes starting; fail after the wait timeout."""
        starting = self.ring is None and view.now - self.started_at < self.settings.start_grace
        live = self._starting_nodes(view) | self._alive_nodes(view)
        if starting or len(live) >= self.settings.min_workers:
            self.below_min_since = None
            return []
        alive = ready
        if self.below_min_since is None:
            self.below_min_since = view.now
            return [
                Log(
                    f"waiting for workers: {alive} of at least {self.settings.min_workers} ready "
                    f"(the job fails after {self.settings.wait_timeout:.0f} s)"
                )
            ]
        if view.now - self.below_min_since < self.settings.wait_timeout:
            return []
        reason = (
            f"only {alive} of at least {self.settings.min_workers} workers were ready for "
            f"{self.settings.wait_timeout:.0f} s (--min-workers)"
        )
        if self.failure:
            reason += f"; last failure: {self.failure}"
        return self._finish(False, reason, view)

    def _form(self, view: JobView, target: tuple[str, ...], cause: EpochCause) -> list[Decision]:
        previous = self.ring
        epoch = (previous.epoch if previous else 0) + 1
        waiting = tuple(s for s in target if s not in view.waiting)
        self.ring = Ring(
            epoch,
            target,
            RingState.FORMING,
            self.rendezvous,
            waiting,
            cause,
            has_run=previous is not None and previous.trained,
        )
        before = self.member_incarnations
        self.member_incarnations = {s: view.procs[s].incarnation for s in target if s in view.procs}
        self.epoch_since = view.now
        decisions: list[Decision] = [
            Log(f"forming epoch {epoch} ({cause.value}): {len(target)} ranks {list(target)}"),
            self._write_ring(),
        ]
        joined = tuple(s for s in target if before.get(s) != self.member_incarnations.get(s))
        if previous is not None:
            decisions += [Log(f"slot {slot} joined") for slot in joined]
            leavers = tuple(
                slot
                for slot in previous.slots
                if slot not in target
                and (proc := view.procs.get(slot)) is not None
                and proc.incarnation == before.get(slot)
                and (slot, proc.incarnation) not in self.handled_exits  # crashed, not left
            )
            decisions += [Log(f"slot {slot} leaves the ring") for slot in leavers]
            if leavers:
                decisions.append(
                    MembershipChange(
                        ChangeKind.LEFT,
                        epoch,
                        leavers,
                        f"epoch {epoch}: {', '.join(leavers)} left the ring",
                    )
                )
        if joined:
            decisions.append(
                MembershipChange(
                    ChangeKind.JOINED,
                    epoch,
                    joined,
                    f"epoch {epoch}: {', '.join(joined)} joined "
                    f"(ranks {', '.join(str(target.index(s)) for s in joined)} of {len(target)})",
                )
            )
        if previous is not None and cause is EpochCause.RESIZE:
            survivors = tuple(s for s in previous.slots if s in view.procs)
            decisions.append(NotifyWorkers(survivors, epoch))
        return decisions

    def _maybe_start_epoch(self, view: JobView) -> list[Decision]:
        ring = self.ring
        decisions: list[Decision] = []
        if ring is None:
            # Before the first epoch: a process of a leaving node need not wait for it (one
            # whose member record the view does not hold yet is not leaving).
            leaving = [
                s
                for s in view.waiting
                if (member := view.members.get(split_slot(s)[0])) is not None and member.leaving
            ]
            if leaving:
                decisions.append(ReleaseWaiters(0, tuple((s, REMOVED) for s in leaving)))
            return decisions
        outsiders = [
            s
            for s, kind in view.waiting.items()
            if s not in ring.slots and (kind == WaitKind.RESET or not self._may_join_later(s, view))
        ]
        if outsiders:
            decisions.append(ReleaseWaiters(ring.epoch, tuple((s, REMOVED) for s in outsiders)))
        if ring.state is not RingState.FORMING:
            return decisions
        waiting = tuple(s for s in ring.slots if s not in view.waiting)
        if waiting:
            if waiting != ring.waiting:
                self.ring = replace(ring, waiting=waiting)
                decisions.append(self._write_ring())
            return decisions
        self.ring = replace(ring, state=RingState.RUNNING, waiting=(), has_run=True)
        self.holders = set(ring.slots)
        self._remember_epoch(ring)
        took = view.now - self.epoch_since
        ranks = ", ".join(f"{rank}={slot}" for rank, slot in enumerate(ring.slots))
        decisions += [
            self._write_ring(),
            ReleaseWaiters(ring.epoch, tuple((s, self.ring.assignment(s)) for s in ring.slots)),
            Log(
                f"epoch {ring.epoch} running with {len(ring.slots)} ranks; "
                f"re-formed in {took:.2f} s"
            ),
            MembershipChange(
                ChangeKind.REFORMED,
                ring.epoch,
                ring.slots,
                f"epoch {ring.epoch} ({ring.cause.value}) running with {len(ring.slots)} ranks "
                f"[{ranks}]; formed in {took:.2f} s",
                cause=ring.cause,
                duration=took,
            ),
        ]
        return decisions

    def _write_ring(self) -> WriteRing:
        """Write :attr:`ring` with the restarts spent so far and its members' incarnations (a
        successor goes on from there, and tells the members from later processes of a slot)."""
        assert self.ring is not None
        self.ring = replace(
            self.ring,
            restarts_used=self.budget.used,
            incarnations=tuple(self.member_incarnations.get(s, 0) for s in self.ring.slots),
        )
        return WriteRing(self.ring)

    def _may_join_later(self, slot: str, view: JobView) -> bool:
        node, _ = split_slot(slot)
        member = view.members.get(node)
        return member is not None and not member.leaving and slot not in self.abandoned

    def _watch_for_stuck_members(self, view: JobView) -> list[Decision]:
        ring = self.ring
        if ring is None or ring.state is not RingState.FORMING:
            return []
        silent_for = view.now - self.epoch_since
        if ring.cause is EpochCause.RESIZE and silent_for > self.settings.resize_timeout:
            if len(self.holders) == 1 and set(ring.waiting) == self.holders:
                # A ring of one: its collectives never touch the network, so nothing can
                # interrupt it, and killing it would lose the only copy of the state. The
                # newcomers wait until it commits, or its script ends.
                if self._alone_told != ring.epoch:
                    self._alone_told = ring.epoch
                    return [
                        Log(
                            f"epoch {ring.epoch}: slot {ring.waiting[0]}, a ring of one, has "
                            f"not reached a commit in {silent_for:.0f} s; the newcomers wait for "
                            "its next commit (a ring of one cannot be interrupted)"
                        )
                    ]
                return []
            self.ring = replace(ring, cause=EpochCause.FAILURE)
            self.epoch_since = view.now
            return [
                Log(
                    f"epoch {ring.epoch}: members did not reach a commit in time; interrupting them"
                ),
                self._write_ring(),
            ]
        if ring.cause is not EpochCause.FAILURE or silent_for <= self.settings.stuck_timeout:
            return []
        decisions: list[Decision] = []
        for slot in ring.waiting:
            why = f"slot {slot} did not leave its failed collective in {silent_for:.1f} s"
            decisions += self._replace_stuck(slot, view, f"{why}; replacing it")
        return decisions

    # -- the end -----------------------------------------------------------------------------

    def _maybe_finish(self, view: JobView) -> list[Decision]:
        members = self.ring.slots if self.ring else ()
        if any(slot in view.procs for slot in members):
            return []
        trained = members
        if self.ring is not None and self.ring.state is RingState.FORMING:
            # The epoch never ran (training ended first): its newcomers had nothing to finish.
            trained = tuple(s for s in members if s in self.holders)
        if self.finish_failure is None and trained and all(s in self.finished for s in trained):
            return self._finish(True, f"training finished on {len(trained)} ranks", view)
        reason = self.finish_failure or self.failure or "training processes exited before finishing"
        return self._finish(False, reason, view)

    def _finish(self, succeeded: bool, reason: str, view: JobView) -> list[Decision]:
        self.phase = Phase.SUCCEEDED if succeeded else Phase.FAILED
        return [FinishJob(succeeded, reason), *self._reject_all_waiters(view)]

    def _reject_all_waiters(self, view: JobView) -> list[Decision]:
        if not view.waiting:
            return []
        epoch = self.ring.epoch if self.ring else 0
        return [ReleaseWaiters(epoch, tuple((s, REMOVED) for s in view.waiting))]
