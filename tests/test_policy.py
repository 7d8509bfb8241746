"""The launcher's ring policy, step by step (pure: no store, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TypeVar

import pytest

from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.records.values import (
    NOT_ADMITTED_EXIT_CODE,
    STATE_MISMATCH_EXIT_CODE,
    JobSettings,
    Ring,
    RingState,
    ScriptError,
)
from elastic_allreduce.rendezvous.model import REMOVED, next_membership
from elastic_allreduce.rendezvous.protocol import WaitKind
from launcher.leader.policy import RingPolicy, missing_at_takeover, parked_nodes
from launcher.vocabulary import (
    Decision,
    Exit,
    FinishJob,
    JobView,
    Log,
    Member,
    MembershipChange,
    NotifyWorkers,
    Proc,
    ReleaseWaiters,
    SetDirective,
    StartNodes,
    StopNode,
    WriteRing,
)

D = TypeVar("D")


@dataclass
class World:
    """A hand-made job: nodes with one slot each, their processes, exits and waiters."""

    now: float = 0.0
    procs: dict[str, Proc] = field(default_factory=dict)
    members: dict[str, Member] = field(default_factory=dict)
    exits: list[Exit] = field(default_factory=list)
    waiting: dict[str, WaitKind] = field(default_factory=dict)
    scale_target: int | None = None
    revision: int = 0

    def add_node(self, node: str, *, ready: bool = True, incarnation: int = 1) -> str:
        self.revision += 1
        self.members.setdefault(node, Member(node, 1, False, self.revision))
        slot = f"{node}.0"
        self.procs[slot] = Proc(slot, incarnation, self.revision)
        if ready:
            self.waiting[slot] = WaitKind.FRESH
        return slot

    def kill(self, slot: str, code: int | None = None, signal: int | None = 9) -> None:
        proc = self.procs.pop(slot)
        self.waiting.pop(slot, None)
        self.exits.append(Exit(slot, proc.incarnation, code, signal, ("Traceback", "boom")))

    def fail(self, slot: str, error: ScriptError) -> None:
        """The slot's script ended with ``error`` (exit code 1, as Python exits)."""
        proc = self.procs.pop(slot)
        self.waiting.pop(slot, None)
        tail = ("Traceback (most recent call last):", *error.lines[-1:])
        self.exits.append(Exit(slot, proc.incarnation, 1, None, tail, error))

    def view(self) -> JobView:
        return JobView(
            self.now,
            dict(self.procs),
            dict(self.members),
            tuple(self.exits),
            dict(self.waiting),
            self.scale_target,
        )


def make_policy(target_workers: int = 3, **overrides: float) -> RingPolicy:
    settings = JobSettings(
        min_workers=int(overrides.pop("min_workers", 1)),
        max_workers=int(overrides.pop("max_workers", 4)),
        nproc_per_node=1,
        max_restarts=int(overrides.pop("max_restarts", 0)),
        **overrides,
    )
    return RingPolicy(settings, "127.0.0.1:1234", started_at=0.0, target_workers=target_workers)


def step(policy: RingPolicy, world: World) -> list[Decision]:
    decisions = policy.step(world.view())
    for decision in decisions:  # what the executor does to the world
        if isinstance(decision, ReleaseWaiters):
            for slot, _ in decision.answers:
                world.waiting.pop(slot, None)
    return decisions


def of(kind: type[D], decisions: list[Decision]) -> list[D]:
    return [d for d in decisions if isinstance(d, kind)]


def answers(decisions: list[Decision]) -> dict[str, int]:
    released: dict[str, int] = {}
    for decision in of(ReleaseWaiters, decisions):
        released.update({slot: a.rank for slot, a in decision.answers})
    return released


def started_job(count: int = 3, **overrides: float) -> tuple[RingPolicy, World, list[str]]:
    policy, world = make_policy(count, **overrides), World()
    policy.nodes_started([f"n{i}" for i in range(count)], 0.0)
    slots = [world.add_node(f"n{i}") for i in range(count)]
    decisions = step(policy, world)
    assert answers(decisions) == {slot: rank for rank, slot in enumerate(slots)}
    return policy, world, slots


def test_the_first_epoch_starts_when_every_initial_worker_is_ready() -> None:
    policy, world = make_policy(), World()
    policy.nodes_started(["n0", "n1", "n2"], 0.0)
    world.add_node("n0")
    world.add_node("n1")
    assert of(WriteRing, step(policy, world)) == []
    world.add_node("n2")
    decisions = step(policy, world)
    rings = [d.ring for d in of(WriteRing, decisions)]
    assert [r.state for r in rings] == [RingState.FORMING, RingState.RUNNING]
    assert rings[-1].epoch == 1 and rings[-1].slots == ("n0.0", "n1.0", "n2.0")
    assert answers(decisions) == {"n0.0": 0, "n1.0": 1, "n2.0": 2}


def test_after_the_start_grace_the_first_epoch_starts_with_enough_workers() -> None:
    policy, world = make_policy(min_workers=2, start_grace=10.0), World()
    world.add_node("n0")
    world.add_node("n1")
    assert of(WriteRing, step(policy, world)) == []
    world.now = 10.5
    assert answers(step(policy, world)) == {"n0.0": 0, "n1.0": 1}


def test_the_start_grace_counts_from_the_first_ready_worker_not_from_the_start() -> None:
    """TensorFlow 2.21's import took 18 s on a loaded machine (make test): a grace counted from
    the job's start was over before any process was ready, and the first ring started with the
    first one alone."""
    policy, world = make_policy(min_workers=1, start_grace=10.0), World()
    policy.nodes_started(["n0", "n1", "n2"], 0.0)
    world.now = 18.0
    world.add_node("n0")
    assert of(WriteRing, step(policy, world)) == []
    world.now = 21.0
    world.add_node("n1")
    assert of(WriteRing, step(policy, world)) == []
    world.now = 28.5  # n2 is not ready 10 s after n0 was: the ring starts without it
    assert answers(step(policy, world)) == {"n0.0": 0, "n1.0": 1}


def test_a_crash_without_restarts_drops_the_slot_and_survivors_keep_their_order() -> None:
    policy, world, slots = started_job()
    world.kill(slots[0])
    decisions = step(policy, world)
    assert SetDirective("n0", ()) in decisions
    ring = of(WriteRing, decisions)[-1].ring
    assert (ring.epoch, ring.state, ring.cause) == (2, RingState.FORMING, "failure")
    assert ring.slots == ("n1.0", "n2.0") and ring.waiting == ("n1.0", "n2.0")
    assert any("crashed: killed by SIGKILL" in d.message for d in of(Log, decisions))
    world.waiting["n2.0"] = WaitKind.RESET
    assert answers(step(policy, world)) == {}
    world.waiting["n1.0"] = WaitKind.RESET
    # The oldest survivor becomes rank 0: it holds the committed state to broadcast.
    assert answers(step(policy, world)) == {"n1.0": 0, "n2.0": 1}


def test_a_restarted_process_joins_as_a_newcomer_never_as_rank_zero() -> None:
    policy, world, slots = started_job(max_restarts=1)
    world.kill(slots[0], code=1, signal=None)
    decisions = step(policy, world)
    assert SetDirective("n0", ((0, 2),)) in decisions
    world.waiting.update({"n1.0": WaitKind.RESET, "n2.0": WaitKind.RESET})
    assert answers(step(policy, world)) == {"n1.0": 0, "n2.0": 1}
    world.add_node("n0", incarnation=2)
    decisions = step(policy, world)
    ring = of(WriteRing, decisions)[0].ring
    assert ring.cause == "resize" and ring.slots == ("n1.0", "n2.0", "n0.0")
    assert NotifyWorkers(("n1.0", "n2.0"), ring.epoch) in decisions
    world.waiting.update({"n1.0": WaitKind.RESET, "n2.0": WaitKind.RESET})
    assert answers(step(policy, world)) == {"n1.0": 0, "n2.0": 1, "n0.0": 2}


def test_restarts_are_counted_and_then_the_job_fails_with_the_scripts_error() -> None:
    policy, world, slots = started_job(count=1, max_restarts=1, wait_timeout=5.0)
    world.kill(slots[0], code=1, signal=None)
    assert SetDirective("n0", ((0, 2),)) in step(policy, world)
    world.add_node("n0", incarnation=2)
    step(policy, world)
    world.kill("n0.0", code=1, signal=None)
    decisions = step(policy, world)
    assert any("no restarts left" in d.message for d in of(Log, decisions))
    world.now = 6.0
    finish = of(FinishJob, step(policy, world))
    assert len(finish) == 1 and not finish[0].succeeded
    assert "exit code 1; last output: Traceback | boom" in finish[0].reason


def test_a_member_that_resets_on_its_own_starts_a_failure_epoch() -> None:
    policy, world, _ = started_job()
    world.waiting["n1.0"] = WaitKind.RESET
    ring = of(WriteRing, step(policy, world))[0].ring
    assert (ring.epoch, ring.cause, ring.waiting) == (2, "failure", ("n0.0", "n2.0"))


def test_a_join_is_a_resize_that_notifies_the_members() -> None:
    policy, world, _ = started_job()
    world.add_node("n3")
    decisions = step(policy, world)
    assert NotifyWorkers(("n0.0", "n1.0", "n2.0"), 2) in decisions
    assert any(d.message == "slot n3.0 joined" for d in of(Log, decisions))
    world.waiting.update({s: WaitKind.RESET for s in ("n0.0", "n1.0", "n2.0")})
    assert answers(step(policy, world)) == {"n0.0": 0, "n1.0": 1, "n2.0": 2, "n3.0": 3}


def test_a_graceful_leave_is_a_resize_and_the_leaver_is_told_it_is_removed() -> None:
    policy, world, _ = started_job()
    world.members["n2"] = Member("n2", 1, True, world.members["n2"].registered)
    decisions = step(policy, world)
    assert NotifyWorkers(("n0.0", "n1.0", "n2.0"), 2) in decisions
    world.waiting.update({s: WaitKind.RESET for s in ("n0.0", "n1.0", "n2.0")})
    decisions = step(policy, world)
    released = {s: a for d in of(ReleaseWaiters, decisions) for s, a in d.answers}
    assert released["n2.0"] == REMOVED
    assert (released["n0.0"].rank, released["n1.0"].rank) == (0, 1)


def test_a_leaver_whose_lease_goes_before_its_exit_report_left_and_did_not_hang() -> None:
    """A loaded machine's order for a graceful leave (make test under load, 2026-12-05): the
    removed process's lease went 2.4 s before its agent's exit report, and the launcher said
    'lost its lease (hung or unreachable)' and then never that the slot left."""
    policy, world, _ = started_job(max_restarts=1)
    world.members["n2"] = Member("n2", 1, True, world.members["n2"].registered)
    step(policy, world)
    world.waiting.update({s: WaitKind.RESET for s in ("n0.0", "n1.0", "n2.0")})
    step(policy, world)
    del world.procs["n2.0"]  # told it is removed, it exits; its lease goes first
    decisions = step(policy, world)
    assert not any("lost its lease" in d.message for d in of(Log, decisions)), decisions
    assert of(MembershipChange, decisions) == []
    world.now += 5.0
    world.exits.append(Exit("n2.0", 1, NOT_ADMITTED_EXIT_CODE, None))
    decisions = step(policy, world)
    assert [d.message for d in of(Log, decisions)] == ["slot n2.0 left (not admitted)"]
    assert of(SetDirective, decisions) == [] and policy.restarts_used == 0


def test_a_lost_lease_replaces_the_hung_process_once_its_node_outlives_the_ttl() -> None:
    policy, world, _ = started_job(max_restarts=1, lease_ttl=3)
    del world.procs["n1.0"]  # lease expired: no exit record
    decisions = step(policy, world)
    assert any("slot n1.0 lost its lease" in d.message for d in of(Log, decisions))
    # The ring moves on at once; the restart waits to see whether the node goes too.
    assert [r.ring.slots for r in of(WriteRing, decisions)][-1] == ("n0.0", "n2.0")
    assert of(SetDirective, decisions) == []
    world.now = 3.9
    assert of(SetDirective, step(policy, world)) == []
    world.now = 4.1
    decisions = step(policy, world)
    assert SetDirective("n1", ((0, 2),)) in decisions
    assert policy.restarts_used == 1


def test_an_exit_report_after_the_lease_loss_says_why_and_is_charged_once() -> None:
    """A loaded machine's order: the process's lease is gone before its agent's exit report
    (the make test run of 2026-12-04 failed with 'lost its lease' instead of the script's error)."""
    policy, world, _ = started_job(count=1, max_restarts=1, wait_timeout=5.0, lease_ttl=3)
    for incarnation in (1, 2):
        del world.procs["n0.0"]  # the lease went first
        decisions = step(policy, world)
        assert any("slot n0.0 lost its lease" in d.message for d in of(Log, decisions))
        assert len(of(MembershipChange, decisions)) == 1  # the crash, counted here
        world.now += 1.0
        world.exits.append(Exit("n0.0", incarnation, 1, None, ("Traceback", "ValueError: boom")))
        decisions = step(policy, world)
        # Handled as the crash it was, at once (not after the TTL), and counted once.
        assert any("crashed: exit code 1" in d.message for d in of(Log, decisions))
        assert of(MembershipChange, decisions) == []
        if incarnation == 1:
            assert SetDirective("n0", ((0, 2),)) in decisions
            assert policy.restarts_used == 1
            world.now += 10.0  # past the TTL and grace: the lost lease is not charged again
            assert of(SetDirective, step(policy, world)) == []
            world.add_node("n0", incarnation=2)
            assert answers(step(policy, world)) == {"n0.0": 0}
    assert any("no restarts left" in d.message for d in of(Log, decisions))
    world.now += 6.0
    finish = of(FinishJob, step(policy, world))
    assert len(finish) == 1 and not finish[0].succeeded
    assert "ValueError: boom" in finish[0].reason and "lost its lease" not in finish[0].reason
    assert policy.restarts_used == 1


def test_a_new_process_that_registers_again_after_its_lease_lapsed_goes_on() -> None:
    """A restarted process importing TensorFlow on a loaded machine (make test under load,
    2026-12-05): its keep-alive reached etcd too late and its lease lapsed; it registered again
    under a new lease 1.6 s later, and the launcher replaced it all the same 2.5 s after that."""
    policy, world, slots = started_job(max_restarts=2, lease_ttl=3)
    world.kill(slots[1])
    assert SetDirective("n1", ((0, 2),)) in step(policy, world)
    world.waiting.update({s: WaitKind.RESET for s in (slots[0], slots[2])})
    step(policy, world)
    world.add_node("n1", ready=False, incarnation=2)  # the new process, importing
    step(policy, world)
    del world.procs["n1.0"]  # its lease lapsed
    decisions = step(policy, world)
    assert any("slot n1.0 lost its lease" in d.message for d in of(Log, decisions))
    world.now += 1.6
    world.procs["n1.0"] = Proc("n1.0", 2, world.revision + 1)  # registered again
    decisions = step(policy, world)
    assert any("n1.0: its process registered again" in d.message for d in of(Log, decisions))
    world.now += 10.0  # well past the lease TTL and the grace
    assert of(SetDirective, step(policy, world)) == []
    assert policy.restarts_used == 1
    world.waiting["n1.0"] = WaitKind.FRESH  # imported: it reaches the barrier and joins
    ring = of(WriteRing, step(policy, world))[0].ring
    assert ring.slots == ("n0.0", "n2.0", "n1.0") and ring.incarnations == (1, 1, 2)
    world.waiting.update({s: WaitKind.RESET for s in (slots[0], slots[2])})
    assert answers(step(policy, world)) == {"n0.0": 0, "n2.0": 1, "n1.0": 2}
    # Its own crash later is a crash like any other: restarted, charged.
    world.kill("n1.0")
    assert SetDirective("n1", ((0, 3),)) in step(policy, world)
    assert policy.restarts_used == 2


def test_a_ring_member_whose_lease_lapsed_is_replaced_though_it_registers_again() -> None:
    """The ring moved on without it at once, so coming back does not put it in again."""
    policy, world, slots = started_job(max_restarts=1, lease_ttl=3)
    proc = world.procs.pop(slots[1])
    step(policy, world)
    world.now += 1.0
    world.procs[slots[1]] = proc
    step(policy, world)
    world.now += 4.0
    assert SetDirective("n1", ((0, 2),)) in step(policy, world)


def test_an_exit_report_before_the_process_record_goes_re_forms_once_without_it() -> None:
    """The other order (the in-process launcher test saw it on a loaded machine: a failure
    epoch that still named the crashed slot, then a second one without it)."""
    policy, world, slots = started_job(max_restarts=1)
    proc = world.procs[slots[0]]
    world.kill(slots[0], code=1, signal=None)
    world.procs[slots[0]] = proc  # its record is still there, under a lease not yet revoked
    decisions = step(policy, world)
    ring = of(WriteRing, decisions)[-1].ring
    assert (ring.epoch, ring.cause, ring.slots) == (2, "failure", ("n1.0", "n2.0"))
    del world.procs[slots[0]]
    assert of(WriteRing, step(policy, world)) == []  # no second re-form when it goes


def test_a_node_cut_off_from_etcd_costs_no_restart() -> None:
    """Its processes' leases and its own expire a moment apart: a network failure, not crashes;
    a node that joined by itself is not replaced, and is taken back when it registers again."""
    policy, world, _ = started_job(count=2, max_restarts=0, lease_ttl=3)
    slot = world.add_node("j1")  # `elastic-run join` on another host
    decisions = step(policy, world)
    assert any("node j1 joined by itself" in d.message for d in of(Log, decisions))
    world.waiting.update({s: WaitKind.RESET for s in ("n0.0", "n1.0")})
    step(policy, world)
    assert policy.ring is not None and slot in policy.ring.slots
    assert policy.target_workers == 3
    del world.procs[slot]  # the process's lease expires first ...
    world.now = 1.0
    step(policy, world)
    del world.members["j1"]  # ... then the node's
    world.now = 1.5
    decisions = step(policy, world)
    assert any(
        "its node j1 was lost too; no restart charged" in d.message for d in of(Log, decisions)
    )
    assert any("node j1 was lost (dead or cut off)" in d.message for d in of(Log, decisions))
    assert of(StartNodes, decisions) == []  # nothing here can start it
    assert policy.target_workers == 2
    world.waiting.update({s: WaitKind.RESET for s in ("n0.0", "n1.0")})  # the survivors re-form
    step(policy, world)
    assert policy.ring.slots == ("n0.0", "n1.0")
    world.now = 10.0
    assert of(SetDirective, step(policy, world)) == []
    assert policy.restarts_used == 0 and policy.failure is None
    # The link comes back: the agent registers again with a new process.
    world.add_node("j1", incarnation=2)
    decisions = step(policy, world)
    assert any("node j1 is back" in d.message for d in of(Log, decisions))
    assert policy.target_workers == 3
    assert of(StopNode, decisions) == []
    assert policy.node_state("j1").value == "registered"


def test_a_member_stuck_in_a_failed_collective_is_replaced() -> None:
    policy, world, slots = started_job(stuck_timeout=5.0, max_restarts=0)
    world.kill(slots[0])
    step(policy, world)
    world.waiting["n1.0"] = WaitKind.RESET
    world.now = 3.0
    assert of(SetDirective, step(policy, world)) == []
    world.now = 6.0
    decisions = step(policy, world)
    assert SetDirective("n2", ((0, 2),)) in decisions
    assert of(SetDirective, step(policy, world)) == []  # once per process


def test_below_min_workers_the_job_waits_then_fails_clearly() -> None:
    policy, world, slots = started_job(count=2, min_workers=2, wait_timeout=5.0)
    world.kill(slots[1])
    decisions = step(policy, world)
    assert any("waiting for workers" in d.message for d in of(Log, decisions))
    world.now = 4.0
    assert of(FinishJob, step(policy, world)) == []
    world.now = 5.5
    (finish,) = of(FinishJob, step(policy, world))
    assert not finish.succeeded
    assert finish.reason.startswith("only 1 of at least 2 workers were ready for 5 s")


def test_nodes_slower_to_start_than_the_grace_are_waited_for_not_failed() -> None:
    # A loaded machine: past the start grace and the wait timeout, no agent has registered yet.
    policy, world = make_policy(min_workers=1, start_grace=10.0, wait_timeout=3.0), World()
    policy.nodes_started(["n0", "n1", "n2"], 0.0)
    for now in (10.5, 14.0, 30.0):
        world.now = now
        assert of(FinishJob, step(policy, world)) == [], now
    # The agents register, their processes not yet: still starting.
    for node in ("n0", "n1", "n2"):
        world.members[node] = Member(node, 1, False, 1)
    for now in (31.0, 40.0):
        world.now = now
        assert of(FinishJob, step(policy, world)) == [], now
    slots = [world.add_node(node) for node in ("n0", "n1", "n2")]
    world.now = 41.0
    assert answers(step(policy, world)) == {slot: rank for rank, slot in enumerate(slots)}


def test_nodes_that_never_register_fail_the_job_after_their_start_timeout() -> None:
    policy, world = make_policy(1, min_workers=1, start_grace=10.0, wait_timeout=3.0), World()
    policy.nodes_started(["n0"], 0.0)
    world.now = 100.0
    assert of(FinishJob, step(policy, world)) == []
    world.now = 121.0  # past NODE_START_TIMEOUT: stopped, no restart left to replace it
    assert StopNode("n0") in step(policy, world)
    world.now = 122.0
    assert any("waiting for workers" in d.message for d in of(Log, step(policy, world)))
    world.now = 125.5
    (finish,) = of(FinishJob, step(policy, world))
    assert finish.reason.startswith("only 0 of at least 1 workers were ready for 3 s")


def test_the_job_succeeds_when_every_member_finished() -> None:
    policy, world, slots = started_job()
    for slot in slots[:2]:
        world.kill(slot, code=0, signal=None)
    assert of(FinishJob, step(policy, world)) == []
    world.add_node("n9")  # a late joiner is turned away while the job finishes
    assert answers(step(policy, world)) == {"n9.0": -1}
    world.kill(slots[2], code=0, signal=None)
    (finish,) = of(FinishJob, step(policy, world))
    assert finish.succeeded


def test_scale_requests_start_or_stop_the_newest_nodes() -> None:
    policy, world, _ = started_job()
    world.scale_target = 4
    assert StartNodes(1) in step(policy, world)
    policy.nodes_started(["n3"], world.now)
    assert of(StartNodes, step(policy, world)) == []  # n3 is on its way
    world.add_node("n3", ready=False)
    assert of(StartNodes, step(policy, world)) + of(StopNode, step(policy, world)) == []
    world.scale_target = 2
    assert of(StopNode, step(policy, world)) == [StopNode("n2"), StopNode("n3")]
    assert of(StopNode, step(policy, world)) == []  # asked once
    world.scale_target = 9  # clamped to --max-workers (4)
    decisions = step(policy, world)
    assert any("scaling to 4 nodes (asked for 9)" in d.message for d in of(Log, decisions))
    assert of(StartNodes, decisions) == [StartNodes(2)]


@pytest.mark.parametrize(
    ("current", "alive", "expected"),
    [
        (("a.0", "b.0", "c.0"), {"c.0": 3, "a.0": 1}, ("a.0", "c.0")),
        (("a.0",), {"a.0": 1, "z.0": 9, "y.0": 5}, ("a.0", "y.0", "z.0")),
        ((), {"b.0": 2, "a.0": 2}, ("a.0", "b.0")),
    ],
)
def test_next_membership_keeps_survivor_order_and_appends_newcomers_oldest_first(
    current: tuple[str, ...], alive: dict[str, int], expected: tuple[str, ...]
) -> None:
    assert next_membership(current, alive) == expected


def test_the_last_holder_of_the_state_hands_it_to_a_newcomer_before_it_leaves() -> None:
    policy, world, slots = started_job(count=2, max_restarts=1)
    world.kill(slots[1])
    step(policy, world)
    world.waiting["n0.0"] = WaitKind.RESET
    assert answers(step(policy, world)) == {"n0.0": 0}
    # The restarted slot is ready to join just as the only member starts to leave.
    world.add_node("n1", incarnation=2)
    world.members["n0"] = Member("n0", 1, True, world.members["n0"].registered)
    decisions = step(policy, world)
    ring = of(WriteRing, decisions)[0].ring
    assert ring.cause == "resize" and ring.slots == ("n0.0", "n1.0"), ring
    world.waiting["n0.0"] = WaitKind.RESET
    # The leaver is rank 0 of the hand-off epoch: it broadcasts the committed state.
    assert answers(step(policy, world)) == {"n0.0": 0, "n1.0": 1}
    ring = of(WriteRing, step(policy, world))[0].ring
    assert ring.slots == ("n1.0",)


def test_a_node_that_joins_by_itself_raises_the_target_up_to_the_maximum() -> None:
    policy, world, _ = started_job(count=2, max_workers=3)
    world.add_node("j1")
    decisions = step(policy, world)
    assert of(StopNode, decisions) == [] and policy.target_workers == 3
    world.add_node("j2")
    assert of(StopNode, step(policy, world)) == [StopNode("j2")]


def test_a_finished_script_whose_lease_lapses_while_it_exits_is_not_a_hang() -> None:
    policy, world, slots = started_job(count=2, max_restarts=2)
    world.procs[slots[0]] = Proc(slots[0], 1, world.procs[slots[0]].registered, finished=True)
    step(policy, world)
    del world.procs[slots[0]]  # the lease lapsed before the process exited
    decisions = step(policy, world)
    assert of(SetDirective, decisions) == [] and of(WriteRing, decisions) == []
    assert any("finished training" in d.message for d in of(Log, decisions))
    # A hang of the other slot, whose script had not ended, is still a hang.
    del world.procs[slots[1]]
    assert any("lost its lease" in d.message for d in of(Log, step(policy, world)))


def test_a_newcomer_whose_epoch_never_ran_does_not_fail_a_finished_job() -> None:
    policy, world, slots = started_job(count=2)
    world.add_node("n2")
    ring = of(WriteRing, step(policy, world))[0].ring
    assert ring.state is RingState.FORMING and "n2.0" in ring.slots
    # Training ends before the members reach a commit: they finish, the newcomer is sent away.
    for slot in slots:
        world.kill(slot, code=0, signal=None)
    world.kill("n2.0", code=75, signal=None)
    finish = of(FinishJob, step(policy, world))
    assert len(finish) == 1 and finish[0].succeeded, finish
    assert finish[0].reason == "training finished on 2 ranks"


def test_a_hung_member_is_replaced_once_without_using_the_restart_budget() -> None:
    policy, world, slots = started_job(max_restarts=0)
    decisions = policy.replace_hung((slots[1],), world.view())
    assert SetDirective("n1", ((0, 2),)) in decisions
    assert policy.replace_hung((slots[1],), world.view()) == []  # already being replaced
    world.kill(slots[1])  # the agent killed it (SIGKILL)
    decisions = step(policy, world)
    assert any("killed because it was stuck" in d.message for d in of(Log, decisions))
    assert not of(FinishJob, decisions) and policy.restarts_used == 0


def test_a_state_mismatch_fails_the_job_at_once_even_with_restarts_left() -> None:
    policy, world, slots = started_job(max_restarts=5)
    world.kill(slots[2], code=STATE_MISMATCH_EXIT_CODE, signal=None)
    [finish] = of(FinishJob, step(policy, world))
    assert not finish.succeeded and "slot n2.0 crashed: exit code 76" in finish.reason
    assert policy.restarts_used == 0


def script_error(message: str = "bad batch at step 3", *, trained: bool = True) -> ScriptError:
    lines = ('  File "train.py", line 40, in train', f"ValueError: {message}")
    return ScriptError("ValueError", message, 1, trained, lines)


def test_every_rank_failing_with_the_same_error_fails_the_job_at_once() -> None:
    """Issue #39: a bug in the script that fails every rank alike is reported at once: no
    restart after the last rank's failure, no wait for --wait-timeout."""
    policy, world, slots = started_job(count=2, max_restarts=3, wait_timeout=60.0)
    world.fail(slots[0], script_error())
    decisions = step(policy, world)
    # One rank's error, as far as anyone knows yet: restarted as any crash.
    assert SetDirective("n0", ((0, 2),)) in decisions and not of(FinishJob, decisions)
    world.fail(slots[1], script_error())
    decisions = step(policy, world)
    [finish] = of(FinishJob, decisions)
    assert not finish.succeeded
    assert finish.reason.startswith(
        "every rank of ring epoch 1 (2 ranks) failed alike: ValueError: bad batch at step 3 -- "
        "a bug in the script, not retried; its last lines: "
    )
    assert "ValueError: bad batch at step 3" in finish.reason.rsplit("|", 1)[-1]
    assert not of(SetDirective, decisions)  # nothing restarted for it
    assert policy.restarts_used == 1


def test_a_rank_whose_collective_failed_first_and_met_the_error_later_counts_too() -> None:
    """The rank whose peer raised first sees a failed collective, re-forms alone and meets the
    same error at the same step: every member of epoch 1 ended with it."""
    policy, world, slots = started_job(count=2, max_restarts=3)
    world.fail(slots[0], script_error())
    step(policy, world)
    world.waiting[slots[1]] = WaitKind.RESET
    assert answers(step(policy, world)) == {slots[1]: 0}  # epoch 2: the survivor alone
    world.fail(slots[1], script_error())
    [finish] = of(FinishJob, step(policy, world))
    assert "every rank of ring epoch 1 (2 ranks) failed alike" in finish.reason


def test_errors_that_differ_in_type_or_message_are_crashes_of_one_rank() -> None:
    policy, world, slots = started_job(count=2, max_restarts=3)
    world.fail(slots[0], script_error("bad batch at step 3"))
    step(policy, world)
    world.fail(slots[1], script_error("bad batch at step 4"))
    decisions = step(policy, world)
    assert SetDirective("n1", ((0, 2),)) in decisions and not of(FinishJob, decisions)
    world.add_node("n1", incarnation=2)
    other = replace(script_error("bad batch at step 4"), kind="KeyError")
    world.fail("n1.0", other)
    decisions = step(policy, world)
    assert not of(FinishJob, decisions), "a KeyError after a ValueError is another error"


def test_a_restarted_process_failing_again_before_a_step_fails_the_job() -> None:
    """A ring of one, or a rank whose error the others do not reach: its restart meets the same
    error again before it trained a step."""
    policy, world, slots = started_job(count=1, max_restarts=3, wait_timeout=60.0)
    world.fail(slots[0], script_error())
    assert SetDirective("n0", ((0, 2),)) in step(policy, world)
    world.add_node("n0", incarnation=2)
    step(policy, world)
    world.fail("n0.0", script_error(trained=False))
    [finish] = of(FinishJob, step(policy, world))
    assert finish.reason.startswith(
        "slot n0.0's restarted process (incarnation 2) failed again as its predecessor did, "
        "before it trained a step: ValueError: bad batch at step 3"
    )
    assert policy.restarts_used == 1


def test_a_restarted_process_that_trained_before_the_same_error_is_restarted() -> None:
    policy, world, slots = started_job(count=1, max_restarts=3)
    world.fail(slots[0], script_error())
    step(policy, world)
    world.add_node("n0", incarnation=2)
    step(policy, world)
    world.fail("n0.0", script_error(trained=True))
    decisions = step(policy, world)
    assert SetDirective("n0", ((0, 3),)) in decisions and not of(FinishJob, decisions)


def test_a_signal_is_never_a_bug_in_the_script() -> None:
    policy, world, slots = started_job(count=2, max_restarts=3)
    world.kill(slots[0])
    world.kill(slots[1])
    decisions = step(policy, world)
    assert not of(FinishJob, decisions) and policy.restarts_used == 2


def test_members_that_miss_their_commit_in_a_resize_are_interrupted_as_a_failure() -> None:
    policy, world, _ = started_job(count=2, resize_timeout=60.0, stuck_timeout=5.0)
    world.add_node("n2")
    ring = of(WriteRing, step(policy, world))[0].ring
    assert (ring.cause, ring.waiting) == ("resize", ("n0.0", "n1.0"))
    world.now = 61.0
    decisions = step(policy, world)
    assert of(WriteRing, decisions)[0].ring.cause == "failure"
    assert any("did not reach a commit in time" in d.message for d in of(Log, decisions))


def test_a_ring_of_one_that_misses_its_commit_is_waited_for_never_killed() -> None:
    """Issue #39 (a script that never commits): a lone rank's collectives never touch the
    network, so it cannot be interrupted, and killing it would lose the only copy of the
    state. The newcomer waits; the lone rank is not replaced as stuck."""
    policy, world, slots = started_job(count=2, max_restarts=2, resize_timeout=60.0)
    world.kill(slots[1])
    step(policy, world)
    world.waiting[slots[0]] = WaitKind.RESET
    assert answers(step(policy, world)) == {slots[0]: 0}  # a ring of one
    world.add_node("n1", incarnation=2)
    ring = of(WriteRing, step(policy, world))[0].ring
    assert (ring.cause, ring.waiting) == ("resize", (slots[0],))
    world.now = 61.0
    [log] = step(policy, world)
    assert isinstance(log, Log) and "a ring of one cannot be interrupted" in log.message
    for now in (70.0, 200.0, 1000.0):
        world.now = now
        assert step(policy, world) == []
    assert policy.ring is not None and policy.ring.cause == "resize"


def test_fail_ends_the_job_with_the_reason_once() -> None:
    policy, world, _ = started_job()
    [finish] = of(FinishJob, policy.fail("the ring hung twice", world.view()))
    assert finish == FinishJob(False, "the ring hung twice")
    assert policy.fail("again", world.view()) == []


def test_nodes_that_cannot_reach_each_other_are_split_keeping_the_larger_side() -> None:
    members = {
        n: Member(n, 1, False, i, frozenset(cut))
        for i, (n, cut) in enumerate(
            [("a", {"c"}), ("b", {"c"}), ("c", {"a", "b"})]  # c is cut off from a and b
        )
    }
    assert parked_nodes(members, holders=set()) == {"c"}
    # One cut pair: the later registered goes, unless only it holds the newest commit.
    pair = {
        "a": Member("a", 1, False, 1, frozenset({"b"})),
        "b": Member("b", 1, False, 2, frozenset({"a"})),
    }
    assert parked_nodes(pair, holders=set()) == {"b"}
    assert parked_nodes(pair, holders={"b"}) == {"a"}
    # A node with more ranks is kept before one with fewer.
    pair["b"] = Member("b", 4, False, 2, frozenset({"a"}))
    assert parked_nodes(pair, holders=set()) == {"a"}
    # Only one side reports: the other is dead (its record is stale); its leases decide.
    pair["b"] = Member("b", 4, False, 2)
    assert parked_nodes(pair, holders=set()) == set()
    assert parked_nodes({"a": Member("a", 1, False, 1, frozenset({"gone"}))}, set()) == set()


def test_a_node_that_cannot_reach_a_peer_leaves_the_ring_free_and_rejoins() -> None:
    policy, world, _ = started_job(count=3, max_restarts=0)
    world.members["n0"] = Member("n0", 1, False, 1, frozenset({"n2"}))
    assert of(WriteRing, step(policy, world)) == []  # one side only: nothing yet
    world.members["n2"] = Member("n2", 1, False, 3, frozenset({"n0"}))
    decisions = step(policy, world)
    assert any("node n2 and n0 cannot reach each other" in d.message for d in of(Log, decisions)), (
        decisions
    )
    assert SetDirective("n2", ((0, 2),)) in decisions  # replaced, no budget
    ring = [d.ring for d in of(WriteRing, decisions)][-1]
    assert ring.slots == ("n0.0", "n1.0") and ring.cause.value == "failure"
    world.kill("n2.0")  # the agent kills the old process ...
    world.add_node("n2", incarnation=2)  # ... and its new one waits at the barrier
    world.waiting.update({"n0.0": WaitKind.RESET, "n1.0": WaitKind.RESET})
    step(policy, world)
    assert policy.ring is not None and policy.ring.slots == ("n0.0", "n1.0")
    assert policy.ring.state is RingState.RUNNING
    assert "n2.0" in world.waiting  # kept waiting, not sent away
    assert policy.restarts_used == 0 and policy.failure is None
    # The probes succeed again: the waiting process joins at the next resize.
    world.members["n0"] = Member("n0", 1, False, 1)
    world.members["n2"] = Member("n2", 1, False, 3)
    decisions = step(policy, world)
    assert any("node n2 reaches every peer again" in d.message for d in of(Log, decisions))
    ring = [d.ring for d in of(WriteRing, decisions)][-1]
    assert ring.slots == ("n0.0", "n1.0", "n2.0") and ring.cause.value == "resize"


def test_a_node_leaving_before_the_first_epoch_is_not_kept_waiting() -> None:
    policy, world = make_policy(target_workers=2, min_workers=2), World()
    policy.nodes_started(["n0", "n1"], 0.0)
    world.add_node("n0")
    world.waiting["n1.0"] = WaitKind.FRESH  # its member record is not in the view yet
    assert of(ReleaseWaiters, step(policy, world)) == []  # neither is sent away
    del world.waiting["n1.0"]
    world.members["n0"] = Member("n0", 1, True, 1)  # SIGTERM to its agent
    assert answers(step(policy, world)) == {"n0.0": REMOVED.rank}


def test_the_rings_carry_the_restarts_spent_and_a_successor_goes_on_from_there() -> None:
    policy, world, slots = started_job(count=2, max_restarts=1)
    world.kill(slots[0], code=1, signal=None)
    decisions = step(policy, world)
    assert SetDirective("n0", ((0, 2),)) in decisions
    ring = of(WriteRing, decisions)[-1].ring
    assert ring.restarts_used == 1
    # A launcher that takes the job over from this ring has no restart left to spend.
    successor = make_policy(2, max_restarts=1)
    world.waiting.clear()
    successor.adopt(ring, world.view(), {"n0": {0: 2}, "n1": {0: 1}})
    assert successor.restarts_used == 1
    world.kill("n1.0", code=1, signal=None)
    decisions = step(successor, world)
    assert any("no restarts left" in d.message for d in of(Log, decisions)), decisions
    assert SetDirective("n1", ()) in decisions


def running_ring(world: World, nodes: int) -> Ring:
    """A ring epoch 1 of ``nodes`` nodes that joined by themselves, formed by a launcher
    whose successor is under test."""
    leader = make_policy(0, min_workers=nodes, max_workers=nodes)
    for i in range(nodes):
        world.add_node(f"n{i}")
    step(leader, world)
    assert leader.ring is not None and leader.ring.state is RingState.RUNNING
    return leader.ring


def test_adopted_nodes_the_provisioner_manages_are_replaced_when_lost_the_others_are_not() -> None:
    """Issue #12: after a takeover, the nodes an earlier launcher started (the provisioner
    adopts them: its agents, its pods) are replaced when lost, like this launcher's own; a
    node that joined by itself is not (nothing here can start it)."""
    world = World()
    stored = running_ring(world, 3)
    world.waiting.clear()
    successor = make_policy(3, max_workers=3, max_restarts=2)
    successor.adopt(stored, world.view(), {})
    successor.manage({"n0", "n1"})  # n2 joined by itself
    for node in ("n1", "n2"):  # both hosts die
        del world.procs[f"{node}.0"]
        del world.members[node]
    world.now = 5.0
    decisions = step(successor, world)
    logs = [d.message for d in of(Log, decisions)]
    assert "node n1 was lost; starting a replacement" in logs, logs
    assert any("node n2 was lost (dead or cut off); it rejoins" in m for m in logs), logs
    assert of(StartNodes, decisions) == [StartNodes(1)]  # for n1 only
    assert successor.target_workers == 2 and successor.restarts_used == 1


def test_a_takeover_right_after_an_outage_waits_for_the_ring_to_register_again() -> None:
    """Issue #12 (soak): a standby that takes over as etcd comes back from a quorum loss
    finds every lease expired. It waits for the ring's nodes to register again: it starts no
    node (--workers 0) and stops none, and the ring goes on as it was."""
    world = World()
    stored = running_ring(world, 2)
    successor = make_policy(0, min_workers=2, max_workers=2)  # `run --standby --workers 0`
    world.members, world.procs, world.waiting = {}, {}, {}  # every lease expired
    world.now = 10.0
    decisions = successor.adopt(stored, world.view(), {}, hold=8.0)
    waited = [*decisions, *step(successor, world)]
    # Meanwhile the launcher counts them as members (a node that asks is not cut off).
    assert successor.awaited_nodes == {"n0", "n1"}
    world.now = 12.0
    world.add_node("n0")  # registered again (a new revision), its process too
    world.waiting.clear()
    waited += step(successor, world)
    assert of(StartNodes, waited) == [] and of(StopNode, waited) == [], waited
    assert of(Log, waited) == decisions  # nothing is decided about them while they are away
    (waiting,) = of(Log, decisions)
    assert "node n0, node n1 not registered" in waiting.message, waiting
    assert "waiting up to 8 s for them to register again" in waiting.message, waiting
    world.now = 13.0
    world.add_node("n1")
    world.waiting.clear()
    decisions = step(successor, world)
    assert any("took over ring epoch 1" in d.message for d in of(Log, decisions)), decisions
    for _ in range(3):
        world.now += 1.0
        decisions += step(successor, world)
    decisions += waited
    assert of(StartNodes, decisions) == [] and of(StopNode, decisions) == []
    assert of(WriteRing, decisions) == []  # no new epoch: the ranks go on training
    assert successor.ring == stored
    assert successor.target_workers == 2 and successor.restarts_used == 0


def test_a_takeover_stops_waiting_when_the_hold_ends_and_starts_no_node_itself() -> None:
    """A node that does not come back within the hold is lost; with --workers 0 the
    successor waits for workers (--min-workers) instead of starting any."""
    world = World()
    stored = running_ring(world, 2)
    successor = make_policy(0, min_workers=2, max_workers=2)
    world.members, world.procs, world.waiting = {}, {}, {}
    world.now = 10.0
    successor.adopt(stored, world.view(), {}, hold=8.0)
    world.now = 12.0
    world.add_node("n0")
    world.waiting.clear()
    assert step(successor, world) == []
    world.now = 18.5  # the hold is over: n1 is gone
    decisions = step(successor, world)
    assert not successor.adopting
    assert successor.awaited_nodes == frozenset()
    assert any("waiting for workers: 1 of at least 2" in d.message for d in of(Log, decisions)), (
        decisions
    )
    assert of(StartNodes, decisions) == [] and of(StopNode, decisions) == []
    assert successor.target_workers == 1


def test_a_takeover_with_every_member_registered_does_not_wait() -> None:
    world = World()
    stored = running_ring(world, 2)
    successor = make_policy(0, min_workers=2, max_workers=2)
    decisions = successor.adopt(stored, world.view(), {}, hold=8.0)
    assert not successor.adopting
    assert any("took over ring epoch 1" in d.message for d in of(Log, decisions)), decisions
    assert step(successor, world) == []


def test_a_takeover_waits_for_no_slot_whose_exit_was_reported() -> None:
    world = World()
    stored = running_ring(world, 2)
    world.waiting.clear()
    world.kill("n1.0", code=1, signal=None)  # its agent reported the exit: nothing to wait for
    successor = make_policy(0, min_workers=2, max_workers=2)
    assert missing_at_takeover(stored, world.view()) == ()
    del world.members["n1"]
    assert missing_at_takeover(stored, world.view()) == ("node n1",)
    successor.adopt(stored, world.view(), {}, hold=8.0)
    assert successor.adopting  # a node that is gone is waited for, whatever its slots did


def test_a_takeover_tells_the_rings_members_from_processes_restarted_since() -> None:
    """Issue #12 (soak, fault 12): the leader dies as etcd returns from a quorum loss; the
    agents, cut off past their leases, fenced themselves and started new incarnations of
    their processes, which wait at the rendezvous. The ring names its members' incarnations,
    so the successor sees that none of them survives and forms a failure epoch for the new
    processes (before, it took them for the members and sent them away after 120 s)."""
    world = World()
    stored = running_ring(world, 2)
    assert stored.incarnations == (1, 1)
    successor = make_policy(0, min_workers=2, max_workers=2)
    world.members, world.procs, world.waiting = {}, {}, {}
    world.now = 10.0
    for node in ("n0", "n1"):
        world.add_node(node, incarnation=2)  # fenced, registered again, waiting as newcomers
    decisions = successor.adopt(stored, world.view(), {"n0": {0: 2}, "n1": {0: 2}}, hold=8.0)
    assert not successor.adopting  # every node and slot is registered
    decisions += step(successor, world)
    (formed,) = [d.ring for d in of(WriteRing, decisions) if d.ring.state is RingState.FORMING]
    assert formed.epoch == 2 and formed.cause.value == "failure"
    assert formed.incarnations == (2, 2)
    assert answers(decisions) == {"n0.0": 0, "n1.0": 1}
    assert of(StopNode, decisions) == [] and successor.restarts_used == 0


def test_a_ring_written_before_incarnations_were_recorded_is_adopted_from_the_processes() -> None:
    """An older ring record has no incarnations: the successor takes the processes it finds
    for the members, as it did before (no new epoch)."""
    world = World()
    stored = replace(running_ring(world, 2), incarnations=())
    world.waiting.clear()
    successor = make_policy(0, min_workers=2, max_workers=2)
    successor.adopt(stored, world.view(), {})
    assert stored.incarnation("n0.0") is None
    assert step(successor, world) == []


def test_a_restarted_process_is_not_admitted_to_the_epoch_formed_for_its_predecessor() -> None:
    """The whole ring SIGKILLed at once, its exits seen one by one (CI of 2026-12-05): each
    exit re-forms the ring without the dead, so the last epoch formed names a slot whose process
    is dead too. Its restarted process must start a new epoch, not run the one formed for its
    predecessor: that left it alone in a stale epoch while the others formed a ring of their own."""
    policy, world, slots = started_job(max_restarts=3)
    last = slots[-1]
    for slot in slots:
        world.kill(slot)
        step(policy, world)
    ring = policy.ring
    assert ring is not None and ring.slots == (last,) and ring.state is RingState.FORMING
    stale = ring.epoch
    world.add_node(split_slot(last)[0], incarnation=2)  # its restart reaches the barrier first
    decisions = step(policy, world)
    running = [d.ring for d in of(WriteRing, decisions) if d.ring.state is RingState.RUNNING]
    assert [(r.epoch > stale, r.slots, r.incarnations) for r in running] == [(True, (last,), (2,))]
    (release,) = of(ReleaseWaiters, decisions)
    assert release.epoch == running[0].epoch
    # The others come back and join the same ring, one epoch later.
    for slot in slots[:-1]:
        world.add_node(split_slot(slot)[0], incarnation=2)
    decisions = step(policy, world)
    assert policy.ring is not None and set(policy.ring.slots) == set(slots)


def test_the_request_of_a_dead_process_does_not_make_it_a_candidate() -> None:
    """A SIGKILLed process's barrier request stays open at the launcher, and its record until
    its lease is revoked: with its exit reported it is neither admitted nor re-formed for over
    and over (one epoch per step)."""
    policy, world, slots = started_job(max_restarts=3)
    world.kill(slots[0])
    step(policy, world)  # the ring re-forms without it; its restart is asked for
    proc = world.add_node("n0", incarnation=1)  # the dead one's record and request, seen again
    assert proc == slots[0]
    world.waiting.update({s: WaitKind.RESET for s in slots[1:]})
    decisions = step(policy, world)
    assert answers(decisions) == {"n1.0": 0, "n2.0": 1}
    for _ in range(3):
        assert of(WriteRing, step(policy, world)) == []
    world.procs[slots[0]] = Proc(slots[0], 2, world.revision + 1)  # its restart asks
    decisions = step(policy, world)
    ring = of(WriteRing, decisions)[0].ring
    assert ring.state is RingState.FORMING and ring.slots == ("n1.0", "n2.0", "n0.0")
    assert ring.incarnations == (1, 1, 2)
