"""The launcher's decisions, as a pure state machine over snapshots of the job.

:class:`RingPolicy.step` takes a :class:`JobView` (what the store and the rendezvous say now)
and returns the decisions to execute, in order. It does no I/O, so every rule is unit-tested
step by step; :mod:`launcher.launcher` executes the decisions.
"""

from __future__ import annotations

import collections
import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from elastic_allreduce.rendezvous.model import (
    NOT_ADMITTED_EXIT_CODE,
    REMOVED,
    Ring,
    RingState,
    SlotAssignment,
    next_membership,
    split_slot,
)
from elastic_allreduce.store.codec import JsonValue


@dataclass(frozen=True)
class JobSettings:
    """What the user asked for; stored at ``config/job`` so a restarted launcher reads it back."""

    min_workers: int
    max_workers: int
    nproc_per_node: int
    max_restarts: int
    #: Seconds the job may stay below min_workers before it fails.
    wait_timeout: float = 60.0
    #: Seconds the first epoch waits for every initial worker before starting with >= min.
    start_grace: float = 10.0
    #: Seconds a member of a failed epoch may stay silent before it is killed and replaced.
    stuck_timeout: float = 5.0
    #: Seconds members of a resize epoch have to reach their next commit before it is treated
    #: as a failure (their collectives are then interrupted).
    resize_timeout: float = 60.0

    def to_json(self) -> JsonValue:
        return {
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "nproc_per_node": self.nproc_per_node,
            "max_restarts": self.max_restarts,
            "wait_timeout": self.wait_timeout,
            "start_grace": self.start_grace,
            "stuck_timeout": self.stuck_timeout,
            "resize_timeout": self.resize_timeout,
        }

    @classmethod
    def from_json(cls, value: JsonValue) -> JobSettings:
        if not isinstance(value, dict):
            raise ValueError(f"job settings must be an object, got {value!r}")
        return cls(
            min_workers=int(value["min_workers"]),  # type: ignore[arg-type]
            max_workers=int(value["max_workers"]),  # type: ignore[arg-type]
            nproc_per_node=int(value["nproc_per_node"]),  # type: ignore[arg-type]
            max_restarts=int(value["max_restarts"]),  # type: ignore[arg-type]
            wait_timeout=float(value.get("wait_timeout", 60.0)),  # type: ignore[arg-type]
            start_grace=float(value.get("start_grace", 10.0)),  # type: ignore[arg-type]
            stuck_timeout=float(value.get("stuck_timeout", 5.0)),  # type: ignore[arg-type]
            resize_timeout=float(value.get("resize_timeout", 60.0)),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Proc:
    """A live training process (its ``procs/<slot>`` key exists under its own lease)."""

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


@dataclass(frozen=True)
class Exit:
    """A process exit reported by its agent at ``exits/<slot>/<incarnation>``."""

    slot: str
    incarnation: int
    code: int | None
    signal: int | None
    tail: tuple[str, ...] = ()

    @property
    def succeeded(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        if self.code == NOT_ADMITTED_EXIT_CODE:
            return "not admitted"
        return f"exit code {self.code}"


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


@dataclass(frozen=True)
class MembershipChange:
    """A membership change for observers (Kubernetes Events); ``slots`` in rank order for
    REFORMED, else the slots concerned (empty for a node lost before it had processes)."""

    kind: ChangeKind
    epoch: int
    slots: tuple[str, ...]
    message: str


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

#: Seconds a requested node may take to register before it counts as failed to start.
NODE_START_TIMEOUT = 120.0


@dataclass(frozen=True)
class JobView:
    """Everything the policy looks at, read at one moment."""

    now: float
    procs: Mapping[str, Proc]
    members: Mapping[str, Member]
    exits: tuple[Exit, ...]
    waiting: Mapping[str, str]
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


@dataclass
class RingPolicy:
    """The launcher's state machine: one :meth:`step` per change of the view."""

    settings: JobSettings
    rendezvous: str
    started_at: float
    target_workers: int
    ring: Ring | None = None
    phase: Phase = Phase.RUNNING
    epoch_since: float = 0.0
    restarts_used: int = 0
    #: The last crash that cost the job a slot (reported if the job later fails).
    failure: str | None = None
    #: A crash of a member while the others were finishing: the job fails with it.
    finish_failure: str | None = None
    below_min_since: float | None = None
    handled_exits: set[tuple[str, int]] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)
    abandoned: set[str] = field(default_factory=set)
    killed_stuck: set[tuple[str, int]] = field(default_factory=set)
    directives: dict[str, dict[int, int]] = field(default_factory=dict)
    #: The process incarnation of each member of the current ring.
    member_incarnations: dict[str, int] = field(default_factory=dict)
    #: Last incarnation seen alive per slot (to tell a lost lease from a reported exit).
    incarnations: dict[str, int] = field(default_factory=dict)
    #: Nodes requested from the provisioner and when; nodes seen registered.
    requested_nodes: dict[str, float] = field(default_factory=dict)
    seen_nodes: set[str] = field(default_factory=set)
    stopping_nodes: set[str] = field(default_factory=set)
    left_nodes: set[str] = field(default_factory=set)
    lost_nodes: set[str] = field(default_factory=set)
    #: Nodes whose graceful leave lowered the target (undone if the node turns out disrupted).
    voluntary_leaves: set[str] = field(default_factory=set)
    disrupted_handled: set[str] = field(default_factory=set)
    scale_request: int | None = None
    #: Slots whose script ended successfully, with the incarnation that did.
    finishing: dict[str, int] = field(default_factory=dict)
    #: Slots of the last epoch that ran: they hold the committed state (after its sync).
    holders: set[str] = field(default_factory=set)

    # -- the step ----------------------------------------------------------------------------

    def step(self, view: JobView) -> list[Decision]:
        """The decisions for this view, in the order they must be executed."""
        if self.phase in (Phase.SUCCEEDED, Phase.FAILED):
            return self._reject_all_waiters(view)
        decisions: list[Decision] = []
        for exit_ in view.exits:
            decisions += self._on_exit(exit_, view)
        decisions += self._on_lost_leases(view)
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
            self.requested_nodes[node] = now

    # -- lost leases ---------------------------------------------------------------------------

    def _on_lost_leases(self, view: JobView) -> list[Decision]:
        """Slots whose process lease expired with no exit report: hung or cut off."""
        decisions: list[Decision] = []
        for slot, incarnation in list(self.incarnations.items()):
            if slot in view.procs and view.procs[slot].incarnation == incarnation:
                continue
            del self.incarnations[slot]
            if (slot, incarnation) in self.handled_exits:
                continue
            self.handled_exits.add((slot, incarnation))
            node, index = split_slot(slot)
            member = view.members.get(node)
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
            if member is None or member.leaving or self.phase is not Phase.RUNNING:
                decisions.append(Log(problem))
            elif self.restarts_used < self.settings.max_restarts:
                self.restarts_used += 1
                decisions += [
                    Log(f"{problem}; replacing it (restart {self.restarts_used})"),
                    self._set_slot(member, index, incarnation + 1),
                ]
            else:
                self.failure = problem
                self.abandoned.add(slot)
                decisions += [
                    Log(f"{problem}; no restarts left, dropping the slot"),
                    self._set_slot(member, index, None),
                ]
        for slot, proc in view.procs.items():
            self.incarnations[slot] = proc.incarnation
        return decisions

    # -- nodes ---------------------------------------------------------------------------------

    def _provision(self, view: JobView) -> list[Decision]:
        """Keep the number of nodes at the target: scale requests, leaves, lost nodes."""
        decisions: list[Decision] = []
        settings = self.settings
        if view.scale_target is not None and view.scale_target != self.scale_request:
            self.scale_request = view.scale_target
            wanted = max(settings.min_workers, min(settings.max_workers, view.scale_target))
            decisions.append(Log(f"scaling to {wanted} nodes (asked for {view.scale_target})"))
            self.target_workers = wanted
        decisions += self._on_disruptions(view)
        for member in view.members.values():
            if member.leaving and member.node not in self.left_nodes:
                self.left_nodes.add(member.node)
                if member.node not in self.stopping_nodes:
                    self.target_workers -= 1
                    self.voluntary_leaves.add(member.node)
                    decisions.append(Log(f"node {member.node} is leaving gracefully"))
        decisions += self._track_nodes(view)
        if self.phase is not Phase.RUNNING:
            return decisions
        alive = sorted(
            (
                m
                for m in view.members.values()
                if not m.leaving
                and m.node not in self.stopping_nodes
                and m.node not in self.disrupted_handled
            ),
            key=lambda m: m.registered,
        )
        have = len(alive) + len(self.requested_nodes)
        if have < self.target_workers:
            decisions.append(StartNodes(self.target_workers - have))
        elif have > self.target_workers and self.ring is not None:
            for member in alive[max(0, len(alive) - (have - self.target_workers)) :]:
                self.stopping_nodes.add(member.node)
                decisions.append(StopNode(member.node))
        return decisions

    def _on_disruptions(self, view: JobView) -> list[Decision]:
        """Nodes the provisioner reports lost (failed, evicted, preempted, deleted by someone
        else): replaced while restarts last, even when the node's agent left gracefully (the
        SIGTERM of a preemption is not a request to shrink the job)."""
        decisions: list[Decision] = []
        for node, reason in sorted(view.disrupted_nodes.items()):
            if node in self.disrupted_handled or node in self.stopping_nodes:
                continue
            self.disrupted_handled.add(node)
            self.lost_nodes.add(node)
            self.left_nodes.add(node)
            self.requested_nodes.pop(node, None)
            if node in self.voluntary_leaves:
                self.voluntary_leaves.discard(node)
                self.target_workers += 1
            epoch = self.ring.epoch if self.ring else 0
            known = {*view.procs, *(self.ring.slots if self.ring else ())}
            slots = tuple(sorted(s for s in known if split_slot(s)[0] == node))
            if self.phase is not Phase.RUNNING:
                decisions.append(Log(f"node {node} was lost: {reason}"))
                continue
            if self.restarts_used < self.settings.max_restarts:
                self.restarts_used += 1
                message = f"node {node} was lost: {reason}; starting a replacement"
            else:
                self.target_workers -= 1
                self.failure = self.failure or f"node {node} was lost: {reason}"
                message = f"node {node} was lost: {reason}; no restarts left to replace it"
            decisions += [
                Log(message),
                MembershipChange(ChangeKind.CRASHED, epoch, slots, message),
            ]
        return decisions

    def _track_nodes(self, view: JobView) -> list[Decision]:
        """Note registered, late and lost nodes (a lost node is replaced while restarts last)."""
        decisions: list[Decision] = []
        for node in sorted(set(view.members) - self.seen_nodes - set(self.requested_nodes)):
            # Not started by us: `elastic-run join` asks for one more node, within the maximum.
            if self.target_workers < self.settings.max_workers:
                self.target_workers += 1
                decisions.append(
                    Log(f"node {node} joined by itself; the job now wants {self.target_workers}")
                )
        self.seen_nodes |= set(view.members)
        for node in view.pending_nodes & set(self.requested_nodes):
            # The start timeout runs from when the cluster places the node, not while it waits.
            self.requested_nodes[node] = view.now
        for node, since in list(self.requested_nodes.items()):
            if node in self.seen_nodes or view.now - since > NODE_START_TIMEOUT:
                if node not in self.seen_nodes:
                    decisions.append(Log(f"node {node} did not register in time"))
                del self.requested_nodes[node]
        gone = self.seen_nodes - set(view.members) - self.left_nodes - self.stopping_nodes
        for node in sorted(gone - self.lost_nodes):
            self.lost_nodes.add(node)
            if self.phase is not Phase.RUNNING:
                continue
            if self.restarts_used < self.settings.max_restarts:
                self.restarts_used += 1
                decisions.append(Log(f"node {node} was lost; starting a replacement"))
            else:
                self.target_workers -= 1
                decisions.append(Log(f"node {node} was lost; no restarts left to replace it"))
        return decisions

    # -- exits -------------------------------------------------------------------------------

    def _on_exit(self, exit_: Exit, view: JobView) -> list[Decision]:  # noqa: PLR0911
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
        if member is not None and self.restarts_used < self.settings.max_restarts:
            self.restarts_used += 1
            return [
                Log(
                    f"{problem}; restarting it ({self.restarts_used}/{self.settings.max_restarts})"
                ),
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

    def _set_slot(self, member: Member, index: int, incarnation: int | None) -> SetDirective:
        """Directive for a node with one slot changed (None: stop it)."""
        slots = self.directives.setdefault(member.node, {i: 1 for i in range(member.slots)})
        if incarnation is None:
            slots.pop(index, None)
        else:
            slots[index] = incarnation
        return SetDirective(member.node, tuple(sorted(slots.items())))

    # -- membership --------------------------------------------------------------------------

    def _usable(self, slot: str, view: JobView) -> bool:
        node = split_slot(slot)[0]
        member = view.members.get(node)
        return (
            member is not None
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

    def _alive_nodes(self, view: JobView) -> int:
        """Nodes with at least one usable live process (ready or still starting)."""
        return len({split_slot(s)[0] for s in view.procs if self._usable(s, view)})

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
            if kind == "fresh" and slot in view.procs and self._usable(slot, view):
                candidates.setdefault(slot, view.procs[slot].registered)
        target = next_membership(survivors, candidates)
        if ring is None:
            per_node = collections.Counter(split_slot(s)[0] for s in target)
            complete = {n for n, count in per_node.items() if count == self.settings.nproc_per_node}
            grace_over = view.now - self.started_at >= self.settings.start_grace
            # Nodes the cluster cannot place yet are not waited for: they join when they start.
            expected = self.target_workers - len(view.pending_nodes & set(self.requested_nodes))
            enough = len(complete) >= max(expected, self.settings.min_workers)
            if not enough and not (grace_over and len(complete) >= self.settings.min_workers):
                return self._check_min_wait(view, len(complete))
            return self._form(
                view, tuple(s for s in target if split_slot(s)[0] in complete), "start"
            )
        died = [s for s in ring.slots if s not in survivors and not self._left(s, view)]
        resets = [s for s in ring.slots if view.waiting.get(s) == "reset"]
        if ring.state is RingState.RUNNING and not died and not resets and target == ring.slots:
            self.below_min_since = None
            return []
        if ring.state is RingState.FORMING and target == ring.slots:
            return []
        nodes = {split_slot(s)[0] for s in target}
        if len(nodes) < self.settings.min_workers:
            return self._check_min_wait(view, len(nodes))
        self.below_min_since = None
        if ring.state is RingState.FORMING:
            cause = "failure" if (died or ring.cause == "failure") else ring.cause
        else:
            cause = "failure" if (died or resets) else "resize"
        return self._form(view, target, cause)

    def _check_min_wait(self, view: JobView, ready: int) -> list[Decision]:
        """Wait while enough processes are alive (starting up); fail after the wait timeout."""
        starting = self.ring is None and view.now - self.started_at < self.settings.start_grace
        if starting or self._alive_nodes(view) >= self.settings.min_workers:
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

    def _form(self, view: JobView, target: tuple[str, ...], cause: str) -> list[Decision]:
        previous = self.ring
        epoch = (previous.epoch if previous else 0) + 1
        waiting = tuple(s for s in target if s not in view.waiting)
        self.ring = Ring(epoch, target, RingState.FORMING, self.rendezvous, waiting, cause)
        before = self.member_incarnations
        self.member_incarnations = {s: view.procs[s].incarnation for s in target if s in view.procs}
        self.epoch_since = view.now
        decisions: list[Decision] = [
            Log(f"forming epoch {epoch} ({cause}): {len(target)} ranks {list(target)}"),
            WriteRing(self.ring),
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
        if previous is not None and cause == "resize":
            survivors = tuple(s for s in previous.slots if s in view.procs)
            decisions.append(NotifyWorkers(survivors, epoch))
        return decisions

    def _maybe_start_epoch(self, view: JobView) -> list[Decision]:
        ring = self.ring
        decisions: list[Decision] = []
        if ring is None:
            return decisions
        outsiders = [
            s
            for s, kind in view.waiting.items()
            if s not in ring.slots and (kind == "reset" or not self._may_join_later(s, view))
        ]
        if outsiders:
            decisions.append(ReleaseWaiters(ring.epoch, tuple((s, REMOVED) for s in outsiders)))
        if ring.state is not RingState.FORMING:
            return decisions
        waiting = tuple(s for s in ring.slots if s not in view.waiting)
        if waiting:
            if waiting != ring.waiting:
                self.ring = replace(ring, waiting=waiting)
                decisions.append(WriteRing(self.ring))
            return decisions
        self.ring = replace(ring, state=RingState.RUNNING, waiting=())
        self.holders = set(ring.slots)
        took = view.now - self.epoch_since
        ranks = ", ".join(f"{rank}={slot}" for rank, slot in enumerate(ring.slots))
        decisions += [
            WriteRing(self.ring),
            ReleaseWaiters(ring.epoch, tuple((s, self.ring.assignment(s)) for s in ring.slots)),
            Log(
                f"epoch {ring.epoch} running with {len(ring.slots)} ranks; "
                f"re-formed in {took:.2f} s"
            ),
            MembershipChange(
                ChangeKind.REFORMED,
                ring.epoch,
                ring.slots,
                f"epoch {ring.epoch} ({ring.cause}) running with {len(ring.slots)} ranks "
                f"[{ranks}]; formed in {took:.2f} s",
            ),
        ]
        return decisions

    def _may_join_later(self, slot: str, view: JobView) -> bool:
        node, _ = split_slot(slot)
        member = view.members.get(node)
        return member is not None and not member.leaving and slot not in self.abandoned

    def _watch_for_stuck_members(self, view: JobView) -> list[Decision]:
        ring = self.ring
        if ring is None or ring.state is not RingState.FORMING:
            return []
        silent_for = view.now - self.epoch_since
        if ring.cause == "resize" and silent_for > self.settings.resize_timeout:
            self.ring = replace(ring, cause="failure")
            self.epoch_since = view.now
            return [
                Log(
                    f"epoch {ring.epoch}: members did not reach a commit in time; interrupting them"
                ),
                WriteRing(self.ring),
            ]
        if ring.cause != "failure" or silent_for <= self.settings.stuck_timeout:
            return []
        decisions: list[Decision] = []
        for slot in ring.waiting:
            proc = view.procs.get(slot)
            node, index = split_slot(slot)
            member = view.members.get(node)
            if proc is None or member is None or (slot, proc.incarnation) in self.killed_stuck:
                continue
            if proc.incarnation != self.member_incarnations.get(slot):
                continue  # a replacement still starting, not the member that got stuck
            self.killed_stuck.add((slot, proc.incarnation))
            decisions += [
                Log(
                    f"slot {slot} did not leave its failed collective in "
                    f"{silent_for:.1f} s; replacing it"
                ),
                self._set_slot(member, index, proc.incarnation + 1),
            ]
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
