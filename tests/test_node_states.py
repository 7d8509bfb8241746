"""The policy's explicit node states, its restart budget and its target (pure: no I/O)."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from elastic_allreduce.errors import ElasticAllreduceError
from launcher.leader.policy import (
    NODE_START_TIMEOUT,
    NODE_TRANSITIONS,
    NodeState,
    NodeTable,
    PolicyError,
    RestartBudget,
    RingPolicy,
)
from launcher.vocabulary import Decision, Log, Member, StartNodes, StopNode, WriteRing
from tests.test_policy import World, make_policy, of, started_job, step

ALLOWED = sorted(
    ((source, target) for source, targets in NODE_TRANSITIONS.items() for target in targets),
    key=lambda move: (move[0].value, move[1].value),
)
FORBIDDEN = sorted(
    (
        (source, target)
        for source in NodeState
        for target in NodeState
        if target not in NODE_TRANSITIONS[source]
    ),
    key=lambda move: (move[0].value, move[1].value),
)


def path_to(state: NodeState) -> list[NodeState]:
    """The shortest list of moves that takes a new node from UNKNOWN to ``state``."""
    paths: dict[NodeState, list[NodeState]] = {NodeState.UNKNOWN: []}
    queue = deque([NodeState.UNKNOWN])
    while queue:
        current = queue.popleft()
        for following in sorted(NODE_TRANSITIONS[current], key=lambda s: s.value):
            if following not in paths:
                paths[following] = [*paths[current], following]
                queue.append(following)
    return paths[state]


def table_with(node: str, state: NodeState) -> NodeTable:
    table = NodeTable()
    for now, following in enumerate(path_to(state)):
        table.move(node, following, float(now))
    assert table.state(node) is state
    return table


def logs(decisions: list[Decision]) -> list[str]:
    return [d.message for d in of(Log, decisions)]


# -- the transition table ------------------------------------------------------------------


def test_the_table_covers_every_state_and_every_state_is_reachable() -> None:
    assert set(NODE_TRANSITIONS) == set(NodeState)
    assert all(NodeState.UNKNOWN not in targets for targets in NODE_TRANSITIONS.values())
    for state in NodeState:
        assert state is NodeState.UNKNOWN or path_to(state), state
    assert NODE_TRANSITIONS[NodeState.STOPPING] == frozenset()
    assert NODE_TRANSITIONS[NodeState.DISRUPTED] == frozenset()
    assert NODE_TRANSITIONS[NodeState.TIMED_OUT] == frozenset()


@pytest.mark.parametrize(("source", "target"), ALLOWED, ids=lambda s: s.name)
def test_every_allowed_move_is_accepted(source: NodeState, target: NodeState) -> None:
    table = table_with("n0", source)
    assert table.move("n0", target, 99.0) is source
    assert table.state("n0") is target
    assert table.since("n0") == 99.0
    assert table.in_state(target) == ["n0"]


@pytest.mark.parametrize(("source", "target"), FORBIDDEN, ids=lambda s: s.name)
def test_every_other_move_is_refused_and_changes_nothing(
    source: NodeState, target: NodeState
) -> None:
    table = table_with("n0", source)
    with pytest.raises(PolicyError, match=f"node n0 cannot go from {source.value} to "):
        table.move("n0", target, 99.0)
    assert table.state("n0") is source


def test_an_illegal_move_says_which_moves_were_allowed() -> None:
    table = table_with("n7", NodeState.REGISTERED)
    with pytest.raises(PolicyError) as raised:
        table.move("n7", NodeState.REQUESTED, 5.0)
    assert str(raised.value) == (
        "node n7 cannot go from registered to requested "
        "(allowed from registered: disrupted, leaving, lost, stopping)"
    )
    assert isinstance(raised.value, ElasticAllreduceError)
    final = table_with("n8", NodeState.STOPPING)
    with pytest.raises(PolicyError, match=r"allowed from stopping: none"):
        final.move("n8", NodeState.REGISTERED, 5.0)


def test_a_node_never_heard_of_is_unknown_and_has_no_clock() -> None:
    table = NodeTable()
    assert table.state("ghost") is NodeState.UNKNOWN
    with pytest.raises(PolicyError, match="node ghost is unknown"):
        table.since("ghost")
    with pytest.raises(PolicyError, match="node ghost is unknown"):
        table.restart_clock("ghost", 1.0)


# -- node states through RingPolicy.step ---------------------------------------------------


def test_a_node_is_requested_registers_leaves_and_goes_without_costing_a_restart() -> None:
    policy, world = make_policy(3, max_restarts=1), World()
    policy.nodes_started(["n0", "n1", "n2"], 0.0)
    assert [policy.node_state(n) for n in ("n0", "n1", "n2")] == [NodeState.REQUESTED] * 3
    world.add_node("n0")
    world.add_node("n1")
    step(policy, world)
    assert policy.node_state("n0") is NodeState.REGISTERED
    assert policy.node_state("n2") is NodeState.REQUESTED
    world.add_node("n2")
    assert of(WriteRing, step(policy, world))
    assert policy.node_state("n2") is NodeState.REGISTERED
    # Its agent leaves gracefully: the job shrinks by one, and nothing is started in its place.
    world.members["n2"] = Member("n2", 1, True, world.members["n2"].registered)
    decisions = step(policy, world)
    assert policy.node_state("n2") is NodeState.LEAVING
    assert "node n2 is leaving gracefully" in logs(decisions)
    assert policy.target_workers == 2 and policy.target_reason == "node n2 left gracefully"
    assert of(StartNodes, decisions) == []
    # Its member key and process go: a leaver that went, not a lost node to replace.
    del world.members["n2"]
    del world.procs["n2.0"]
    decisions = step(policy, world)
    assert policy.node_state("n2") is NodeState.LEAVING
    assert policy.restarts_used == 0 and policy.target_workers == 2
    assert of(StartNodes, decisions) == []
    assert not [m for m in logs(decisions) if "was lost" in m]


def test_a_node_whose_member_key_vanishes_is_lost_and_replaced_once() -> None:
    policy, world, _ = started_job(max_restarts=2)
    del world.members["n1"]
    del world.procs["n1.0"]
    decisions = step(policy, world)
    assert policy.node_state("n1") is NodeState.LOST
    assert "node n1 was lost; starting a replacement" in logs(decisions)
    assert StartNodes(1) in decisions and policy.restarts_used == 1
    policy.nodes_started(["n3"], world.now)
    again = step(policy, world)
    assert of(StartNodes, again) == [] and policy.restarts_used == 1


def test_a_requested_node_that_never_registers_is_stopped_and_replaced_within_the_budget() -> None:
    """A node placed but never started (an agent that cannot reach etcd; on Kubernetes a pod
    whose containers wait is reported pending instead) used to be forgotten while a duplicate
    was started at every timeout, each stuck one left running."""
    policy, world, _ = started_job(count=2, max_workers=4, max_restarts=1)
    world.scale_target = 3
    assert StartNodes(1) in step(policy, world)
    policy.nodes_started(["n2"], world.now)
    world.now = NODE_START_TIMEOUT + 1
    decisions = step(policy, world)
    assert policy.node_state("n2") is NodeState.TIMED_OUT
    assert StopNode("n2") in decisions
    assert "node n2 did not register within 120 s; stopping it and starting another" in logs(
        decisions
    )
    assert StartNodes(1) in decisions and policy.restarts_used == 1  # in its place
    policy.nodes_started(["n3"], world.now)
    # The stop raced its start: it registers after all, and is let go (not counted, no ranks).
    world.add_node("n2")
    decisions = step(policy, world)
    assert policy.node_state("n2") is NodeState.TIMED_OUT
    assert of(StartNodes, decisions) == [] and policy.target_workers == 3
    # The replacement never registers either: stopped, and with no restarts left the target
    # is lowered instead of starting a third.
    world.now = 2 * NODE_START_TIMEOUT + 2
    decisions = step(policy, world)
    assert StopNode("n3") in decisions and of(StartNodes, decisions) == []
    assert policy.target_workers == 2 and policy.restarts_used == 1
    assert (
        "node n3 did not register within 120 s; stopping it (no restarts left to replace it)"
        in (logs(decisions))
    )
    # No third pod, however long it waits.
    world.now = 10 * NODE_START_TIMEOUT
    assert of(StartNodes, step(policy, world)) == []


def test_a_lease_that_expires_before_the_pod_report_is_charged_once() -> None:
    """A real kubelet reports a dead pod seconds after the node's etcd lease expired: the loss
    is handled at the lease, the report adds neither a restart nor a node."""
    policy, world, _ = started_job(max_restarts=3)
    del world.members["n1"]
    del world.procs["n1.0"]
    decisions = step(policy, world)
    assert StartNodes(1) in decisions and policy.restarts_used == 1
    policy.nodes_started(["n3"], world.now)
    world.now += 5.0
    view = replace(
        world.view(),
        disrupted_nodes={"n1": "pod failed: container worker exited with code 137"},
        dead_nodes=frozenset({"n1"}),
    )
    decisions = policy.step(view)
    assert of(StartNodes, decisions) == [] and policy.restarts_used == 1
    assert policy.target_workers == 3
    assert logs(decisions) == [
        "node n1 was lost: pod failed: container worker exited with code 137 (handled at its "
        "lease loss)"
    ]


def test_scale_down_stops_nodes_for_good_and_a_disruption_is_handled_once() -> None:
    policy, world, _ = started_job(max_restarts=1)
    world.scale_target = 2
    assert of(StopNode, step(policy, world)) == [StopNode("n2")]
    assert policy.node_state("n2") is NodeState.STOPPING
    # The stopped node's pod is deleted: our own doing, not a loss to replace.
    view = replace(world.view(), disrupted_nodes={"n2": "pod deleted", "n1": "pod evicted"})
    decisions = policy.step(view)
    assert policy.node_state("n2") is NodeState.STOPPING
    assert policy.node_state("n1") is NodeState.DISRUPTED
    assert logs(decisions) == ["node n1 was lost: pod evicted; starting a replacement"]
    assert policy.restarts_used == 1
    assert of(Log, policy.step(view)) == []  # the report is cumulative: handled once


def test_a_node_id_started_again_is_not_requested_twice() -> None:
    policy, world, _ = started_job(count=2)
    world.add_node("j1")  # `elastic-run join --node-id j1`
    step(policy, world)
    policy.nodes_started(["j1"], world.now)  # a provisioner handing out the same id
    assert policy.node_state("j1") is NodeState.REGISTERED
    assert policy.nodes.count(NodeState.REQUESTED) == 0


# -- the restart budget ---------------------------------------------------------------------


def test_the_restart_budget_spends_until_it_is_used_up() -> None:
    budget = RestartBudget(2)
    assert [budget.try_spend() for _ in range(4)] == [True, True, False, False]
    assert (budget.used, budget.left) == (2, 0)
    empty = RestartBudget(0)
    assert not empty.try_spend() and empty.used == 0
    with pytest.raises(PolicyError, match="--max-restarts must be 0 or more"):
        RestartBudget(-1)
    with pytest.raises(PolicyError, match="used=3 limit=2"):
        RestartBudget(2, used=3)


def test_crashes_hangs_and_lost_nodes_spend_one_shared_budget() -> None:
    policy, world, _ = started_job(max_restarts=3)
    assert isinstance(policy, RingPolicy) and policy.budget.limit == 3
    world.kill("n0.0", code=1, signal=None)
    assert any("restarting it (1/3)" in m for m in logs(step(policy, world)))
    del world.procs["n1.0"]  # a hang: its lease expired without an exit report ...
    step(policy, world)
    world.now += policy.settings.lease_ttl + 1.5  # ... and its node is still a member
    assert any("replacing it (restart 2)" in m for m in logs(step(policy, world)))
    view = replace(world.view(), disrupted_nodes={"n2": "pod preempted"})
    assert "node n2 was lost: pod preempted; starting a replacement" in logs(policy.step(view))
    assert policy.restarts_used == 3 and policy.budget.left == 0
    world.add_node("n0", incarnation=2)
    step(policy, world)
    world.kill("n0.0", code=1, signal=None)
    assert any("no restarts left, dropping the slot" in m for m in logs(step(policy, world)))
    assert policy.restarts_used == 3


def test_every_target_change_says_why() -> None:
    policy, world, _ = started_job(count=2, max_workers=4, max_restarts=1)
    assert policy.target_reason == "the job's initial size"
    world.scale_target = 3
    step(policy, world)
    assert (policy.target_workers, policy.target_reason) == (
        3,
        "`elastic-run scale` asked for 3 nodes",
    )
    policy.nodes_started(["n2"], world.now)
    world.add_node("n2")
    step(policy, world)
    world.members["n1"] = Member("n1", 1, True, world.members["n1"].registered)
    step(policy, world)
    assert (policy.target_workers, policy.target_reason) == (2, "node n1 left gracefully")
    view = replace(world.view(), disrupted_nodes={"n1": "pod preempted"})
    policy.step(view)
    # Lost, not leaving: its leave no longer shrinks the job (a restart replaces it).
    assert policy.node_state("n1") is NodeState.DISRUPTED
    assert (policy.target_workers, policy.target_reason) == (
        3,
        "node n1 was lost, not leaving: pod preempted",
    )


def test_a_lease_lost_before_the_pod_report_is_charged_once() -> None:
    """Real kubelets report a failed pod after its etcd leases expired: one loss, one restart."""
    policy, world, _ = started_job(max_restarts=3)
    del world.members["n1"]  # the node's lease expired first ...
    del world.procs["n1.0"]
    decisions = step(policy, world)
    assert "node n1 was lost; starting a replacement" in logs(decisions)
    assert policy.restarts_used == 1
    view = replace(world.view(), disrupted_nodes={"n1": "pod failed (OOMKilled)"})
    decisions = policy.step(view)  # ... then the cluster reports the pod
    assert "node n1 was lost: pod failed (OOMKilled) (handled at its lease loss)" in logs(decisions)
    assert policy.restarts_used == 1
    assert policy.node_state("n1") is NodeState.DISRUPTED
