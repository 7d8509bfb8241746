"""RingPolicy with what a cluster provisioner reports: pending, disrupted and dead nodes, and
the membership changes it announces (pure: no store, no processes, no API)."""

from __future__ import annotations

from dataclasses import replace

from elastic_allreduce.records.values import RingState
from elastic_allreduce.rendezvous.protocol import WaitKind
from launcher.leader.policy import NODE_START_TIMEOUT, RingPolicy
from launcher.vocabulary import (
    ChangeKind,
    Decision,
    JobView,
    Log,
    Member,
    MembershipChange,
    StartNodes,
    WriteRing,
)
from tests.test_policy import World, answers, make_policy, of, started_job


def step_with(
    policy: RingPolicy,
    world: World,
    *,
    pending: frozenset[str] = frozenset(),
    disrupted: dict[str, str] | None = None,
    dead: frozenset[str] = frozenset(),
) -> list[Decision]:
    view: JobView = replace(
        world.view(), pending_nodes=pending, disrupted_nodes=disrupted or {}, dead_nodes=dead
    )
    decisions = policy.step(view)
    for slot in answers(decisions):
        world.waiting.pop(slot, None)
    return decisions


def changes(decisions: list[Decision], kind: ChangeKind) -> list[MembershipChange]:
    return [d for d in of(MembershipChange, decisions) if d.kind is kind]


def test_the_first_epoch_does_not_wait_for_pending_pods() -> None:
    policy, world = make_policy(3, min_workers=2, start_grace=10.0), World()
    policy.nodes_started(["n0", "n1", "n2"], 0.0)
    world.add_node("n0")
    world.add_node("n1")
    # Without the report, the first epoch waits for n2 (within the start grace) ...
    assert of(WriteRing, step_with(policy, world)) == []
    # ... with it, it starts at once with the two that run.
    decisions = step_with(policy, world, pending=frozenset({"n2"}))
    assert answers(decisions) == {"n0.0": 0, "n1.0": 1}
    assert changes(decisions, ChangeKind.JOINED)[0].slots == ("n0.0", "n1.0")
    (reformed,) = changes(decisions, ChangeKind.REFORMED)
    assert reformed.epoch == 1 and "0=n0.0, 1=n1.0" in reformed.message
    # The pending pod does not time out, and no second pod is asked for in its place.
    world.now = NODE_START_TIMEOUT + 50
    decisions = step_with(policy, world, pending=frozenset({"n2"}))
    assert of(StartNodes, decisions) == []
    assert not [d for d in of(Log, decisions) if "did not register" in d.message]
    # When it starts, it joins as usual.
    world.add_node("n2")
    ring = of(WriteRing, step_with(policy, world))[0].ring
    assert ring.cause == "resize" and ring.slots == ("n0.0", "n1.0", "n2.0")


def test_pending_pods_do_not_start_a_job_below_min_workers() -> None:
    policy, world = make_policy(3, min_workers=3), World()
    policy.nodes_started(["n0", "n1", "n2"], 0.0)
    world.add_node("n0")
    world.add_node("n1")
    assert of(WriteRing, step_with(policy, world, pending=frozenset({"n2"}))) == []


def test_a_preempted_node_that_leaves_gracefully_is_replaced_not_shrunk() -> None:
    policy, world, _ = started_job(max_restarts=1)
    # The agent's graceful leave (SIGTERM) may arrive before the provisioner's report ...
    world.members["n2"] = Member("n2", 1, True, world.members["n2"].registered)
    assert of(StartNodes, step_with(policy, world)) == []
    assert policy.target_workers == 2
    # ... which turns it into a loss to replace, using the restart budget.
    decisions = step_with(policy, world, disrupted={"n2": "pod preempted by the scheduler"})
    assert policy.target_workers == 3 and policy.restarts_used == 1
    assert StartNodes(1) in decisions
    (crashed,) = changes(decisions, ChangeKind.CRASHED)
    assert crashed.slots == ("n2.0",) and "preempted" in crashed.message
    policy.nodes_started(["n3"], world.now)  # what the executor of StartNodes does
    # Reported again (the report is cumulative): handled once.
    again = step_with(policy, world, disrupted={"n2": "pod preempted by the scheduler"})
    assert of(StartNodes, again) == [] and not changes(again, ChangeKind.CRASHED)


def test_a_lost_pod_without_restarts_left_shrinks_the_target() -> None:
    policy, world, _ = started_job(max_restarts=0)
    decisions = step_with(policy, world, disrupted={"n1": "pod evicted (low memory)"})
    assert of(StartNodes, decisions) == []
    assert policy.target_workers == 2
    assert any("no restarts left" in d.message for d in of(Log, decisions))


def test_a_dead_pods_slot_leaves_the_ring_before_its_lease_expires() -> None:
    policy, world, _ = started_job(max_restarts=1)
    reason = {"n0": "pod failed: container worker exited with code 137 (Error)"}
    # The member and process keys are still there (leases not expired), but the pod is Failed.
    decisions = step_with(policy, world, disrupted=reason, dead=frozenset({"n0"}))
    ring = of(WriteRing, decisions)[0].ring
    assert ring.cause == "failure" and ring.slots == ("n1.0", "n2.0")
    assert ring.state is RingState.FORMING
    assert StartNodes(1) in decisions  # its replacement, at once


def test_crashes_and_graceful_leaves_are_announced() -> None:
    policy, world, slots = started_job(max_restarts=0)
    world.kill(slots[1])
    crash = step_with(policy, world)
    (crashed,) = changes(crash, ChangeKind.CRASHED)
    assert crashed.slots == ("n1.0",) and "SIGKILL" in crashed.message
    world.waiting.update({"n0.0": WaitKind.RESET, "n2.0": WaitKind.RESET})
    step_with(policy, world)
    world.members["n2"] = Member("n2", 1, True, world.members["n2"].registered)
    (left,) = changes(step_with(policy, world), ChangeKind.LEFT)
    assert left.slots == ("n2.0",)


def test_a_replaced_stuck_member_is_not_killed_again_while_it_starts() -> None:
    """Seen in the end-to-end test on a starved machine: below --min-workers the failure epoch
    stays forming, and each new incarnation of a slot replaced as stuck was killed at once."""
    policy, world, slots = started_job(min_workers=2, stuck_timeout=5.0)
    world.kill(slots[0])
    step_with(policy, world)  # failure epoch 2: n1.0 and n2.0 must come back
    world.waiting["n1.0"] = WaitKind.RESET
    step_with(policy, world)
    world.now = 6.0  # n2.0 stays silent: it is replaced by a new incarnation
    decisions = step_with(policy, world)
    assert any("did not leave its failed collective" in d.message for d in of(Log, decisions))
    world.procs["n2.0"] = replace(world.procs["n2.0"], incarnation=2)  # starting up
    world.now = 7.0
    again = step_with(policy, world)
    assert not [d for d in of(Log, again) if "did not leave its failed collective" in d.message]
