"""The faults of a schedule, made one at a time against a running :class:`SoakJob`: each waits
until the job may take it (its share of the epochs trained, every rank of the ring stepping),
is made, and is timed until the job steps again; one function per kind (``KINDS``)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from bench.soak.job import Launcher, Node, SoakJob
from bench.soak.schedule import Fault, Plan, chosen
from bench.soak.settings import (
    END_LIMIT_S,
    ETCD_KINDS,
    ETCD_LIMIT_S,
    FENCE_LIMIT_S,
    HANG_KILL_LIMIT_S,
    HEALTH_LIMIT_S,
    JOIN_LIMIT_S,
    LAUNCHER_LIMIT_S,
    LEAVE_LIMIT_S,
    MAX_NODES,
    RECOVERY_LIMIT_S,
    SPREAD,
    VICTIM_LIMIT_S,
    SoakError,
    poll_until,
    say,
)
from elastic_allreduce.errors import EtcdServerError
from tests.helpers import testhosts


def run_schedule(job: SoakJob, plans: Sequence[Plan]) -> None:
    """Each fault once the job trained its share of the epochs, the last one recovered
    and the plan's gap passed; then the upkeep."""
    last = time.monotonic()
    for plan in plans:
        target = math.floor(plan.index * job.epochs * SPREAD / len(plans))
        with job.tracker.cond:  # behind the epochs: no pause
            ready_at = last if job.tracker.max_epoch >= target else last + plan.gap_s

        def due(target: int = target, ready_at: float = ready_at) -> bool:
            if job.job_over():
                return True
            return job.tracker.max_epoch >= target and time.monotonic() >= ready_at

        job.tracker.wait(due, END_LIMIT_S)
        if job.job_over():
            raise SoakError(f"the job ended before fault {plan.index} of {len(plans)}")
        fault = inject(job, plan)
        fault.waited_s = round(fault.at_s - (last - job.started), 2)
        job.faults.append(fault)
        settle_joins(job)
        recovery = "—" if fault.recovery_s is None else f"{fault.recovery_s:.2f} s"
        if fault.kind == "join" and fault.recovery_s is None:
            recovery = "(pending: a cold start)"
        extra = ", ".join(f"{k} {v:.2f}" for k, v in fault.detail.items() if isinstance(v, float))
        say(
            f"{plan.index}/{len(plans)} {plan.kind} {fault.target} at {fault.ranks_before} "
            f"ranks: stepping again after {recovery}{'; ' + extra if extra else ''}"
            f"{'; PROBLEM: ' + fault.problem if fault.problem else ''}"
        )
        if fault.problem:
            job.problems.append(f"fault {plan.index} ({plan.kind}): {fault.problem}")
        if fault.recovery_s is None and fault.kind != "join" and not job.job_over():
            say(f"fault {plan.index}: no recovery within its limit; waiting for the ring")
        job.tend()
        last = time.monotonic()


def inject(job: SoakJob, plan: Plan) -> Fault:
    """Wait until the job may take ``plan``'s fault, then make it and time the recovery."""
    if plan.kind == "join" and len(job.pool()) >= MAX_NODES:
        job.trim()
    if plan.kind in ("takeover", "adopt"):
        job.ensure_standby()
    if plan.kind in ETCD_KINDS and poll_until(job.etcd.whole, ETCD_LIMIT_S) is None:
        raise SoakError("the etcd cluster is not whole again")
    need = 2  # ranks: the survivors of a kill, a leave or a cut hold the committed state
    if not job.tracker.wait(lambda: job.job_over() or job.tracker.healthy(need), HEALTH_LIMIT_S):
        raise SoakError(f"not {need} ranks stepping within {HEALTH_LIMIT_S:.0f} s")
    if job.job_over():
        raise SoakError(f"the job ended before fault {plan.index}")
    with job.tracker.cond:
        epoch = job.tracker.latest_ring()
        ranks = job.tracker.rings[epoch]
    return _MAKERS[plan.kind](job, plan, epoch, ranks)


def settle_joins(job: SoakJob, final: bool = False) -> None:
    """The recovery of every join whose node has stepped in a ring by now (all of them,
    or a verdict, when ``final``)."""
    for pending in list(job.joining):
        fault, moment, epoch, node = pending
        with job.tracker.cond:
            at = job.tracker.recovered(moment, epoch, need=node.slot)
            if at is not None:
                ring_at = job.tracker.ring_at.values()
                fault.detail["reforms"] = sum(moment <= t <= at for t in ring_at)
        if at is not None:
            fault.recovery_s = at - moment
            say(f"{fault.index} join {node.node_id}: stepping after {fault.recovery_s:.2f} s")
        elif final or time.monotonic() - moment > JOIN_LIMIT_S:
            ended = node.proc.poll()
            fault.problem = (
                f"the new node never stepped (its join exited with {ended})"
                if ended not in (None, 0)
                else f"the new node did not step within {JOIN_LIMIT_S:.0f} s"
            )
            if job.job_over() and ended == 0:
                fault.problem = None
                fault.detail["ended_first"] = True  # the job ended before the node stepped
            if fault.problem:
                job.problems.append(f"fault {fault.index} (join): {fault.problem}")
        else:
            continue
        job.joining.remove(pending)


def _recovery(
    job: SoakJob,
    fault: Fault,
    moment: float,
    min_epoch: int,
    limit: float = RECOVERY_LIMIT_S,
    **which: str,
) -> None:
    """Wait until the job steps again after the fault; note how many ring epochs the
    launcher formed meanwhile (for a fault that changes no ring: a re-form going on)."""
    found: list[float] = []

    def done() -> bool:
        at = job.tracker.recovered(moment, min_epoch, **which)
        if at is not None:
            found.append(at)
        return at is not None or job.job_over()

    job.tracker.wait(done, limit)
    end = found[0] if found else time.monotonic()
    with job.tracker.cond:
        fault.detail["reforms"] = sum(moment <= at <= end for at in job.tracker.ring_at.values())
    fault.recovery_s = found[0] - moment if found else None
    if not found and job.job_over():
        fault.detail["ended_first"] = True


def _hold(job: SoakJob, seconds: float) -> None:
    """A fault's deliberate length: ``seconds``, or until the job ends."""
    job.tracker.wait(job.job_over, seconds)


def _victim(job: SoakJob, plan: Plan) -> tuple[Node, int]:
    """A training process of the newest ring, and its pid."""
    found: list[tuple[Node, int]] = []

    def look() -> bool:
        nodes = job.ring_nodes()
        if nodes:
            first = nodes.index(chosen(nodes, plan.pick))
            for node in nodes[first:] + nodes[:first]:
                pid = job.training_pid(node)
                if pid is not None:
                    found.append((node, pid))
                    return True
        return False

    # A process of the ring may be restarting (its previous fault cost a restart after
    # all): the fault waits for one, as it waits for a healthy ring.
    if poll_until(look, VICTIM_LIMIT_S) is None:
        raise SoakError(f"no training process of the newest ring within {VICTIM_LIMIT_S} s")
    return found[0]


def _fault(job: SoakJob, plan: Plan, moment: float, target: str, ranks: int) -> Fault:
    return Fault(plan.index, plan.kind, round(job.since(moment), 2), target, ranks)


def _took_over(
    job: SoakJob,
    fault: Fault,
    launcher: Launcher,
    moment: float,
    *,
    problem: str,
    after: float = 0.0,
) -> None:
    """Wait until ``launcher`` says it took the ring over (after ``after``) or exits, at most
    LAUNCHER_LIMIT_S; note in ``fault`` when it did (``leader_s``), else ``problem``."""
    job.tracker.wait(
        lambda: (
            job.tracker.saw(launcher.name, "took over ring epoch", after) is not None
            or launcher.proc.poll() is not None
        ),
        LAUNCHER_LIMIT_S,
    )
    with job.tracker.cond:
        took = job.tracker.saw(launcher.name, "took over ring epoch", after)
    if took is None:
        fault.problem = problem
    else:
        fault.detail["leader_s"] = took - moment


# -- the kinds --------------------------------------------------------------------------------


def _kill(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    node, pid = _victim(job, plan)
    moment = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    fault = _fault(job, plan, moment, node.slot, ranks)
    _recovery(job, fault, moment, epoch + 1)
    return fault


def _stop(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    node, pid = _victim(job, plan)
    moment = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    fault = _fault(job, plan, moment, node.slot, ranks)
    if plan.flag:  # a stall, shorter than the agent's limit: the ring stays as it is
        _hold(job, plan.hold_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        fault.detail = {"mode": "stall", "stopped_s": round(time.monotonic() - moment, 3)}
        _recovery(job, fault, moment, epoch)
        return fault
    killed = poll_until(lambda: not testhosts.process_running(pid), HANG_KILL_LIMIT_S)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    fault.detail = {"mode": "hang"}
    if killed is None:
        fault.problem = f"its agent did not kill the stopped process in {HANG_KILL_LIMIT_S} s"
    else:
        fault.detail["killed_s"] = killed
    _recovery(job, fault, moment, epoch + 1)
    return fault


def _leave(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    node = chosen(job.ring_nodes(), plan.pick)
    moment = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    node.state = "leaving"
    fault = _fault(job, plan, moment, node.node_id, ranks)
    _recovery(job, fault, moment, epoch + 1, without=node.slot)

    def exits() -> None:  # in the background: the schedule goes on meanwhile
        try:
            code = node.proc.wait(timeout=LEAVE_LIMIT_S)
        except subprocess.TimeoutExpired:
            problem = f"fault {fault.index} (leave): the node did not exit in {LEAVE_LIMIT_S} s"
            job.problems.append(problem)
            return
        fault.detail["exited_s"] = time.monotonic() - moment
        if code != 0:
            job.problems.append(f"fault {fault.index} (leave): the node exited with {code}")

    threading.Thread(target=exits, name=f"leave-{node.node_id}", daemon=True).start()
    return fault


def _join(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    hosts = job.free_hosts()
    if not hosts:
        raise SoakError("no free host for a join")
    moment = time.monotonic()
    node = job.start_node(chosen(hosts, plan.pick))
    fault = _fault(job, plan, moment, f"{node.node_id} on {node.host.name}", ranks)
    # The join checks the job and registers the node (a second); then its process imports
    # TensorFlow cold (tens of seconds on a busy machine): the schedule goes on meanwhile
    # (the ring still steps), and its recovery is read from the record once it steps.
    job.registered(node)
    job.joining.append((fault, moment, epoch + 1, node))
    return fault


def _takeover(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    leader, standby = job.leader(), job.ensure_standby()
    moment = time.monotonic()
    leader.proc.kill()
    fault = _fault(job, plan, moment, f"{leader.name} (standby {standby.name})", ranks)
    problem = "the standby did not take the job over"
    _took_over(job, fault, standby, moment, problem=problem, after=moment)
    job.standby = None
    _recovery(job, fault, moment, epoch)
    return fault


def _adopt(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    leader, standby = job.leader(), job.ensure_standby()
    standby.stop()  # no standby for this one
    job.standby, job.leaderless = None, True
    moment = time.monotonic()
    leader.proc.kill()
    _hold(job, plan.hold_s)
    adopter = job.launch(standby=False)
    job.leaderless = False
    fault = _fault(job, plan, moment, f"{leader.name}, again as {adopter.name}", ranks)
    fault.detail["leaderless_s"] = time.monotonic() - moment
    problem = "the launcher started again did not adopt the job"
    _took_over(job, fault, adopter, moment, problem=problem)
    _recovery(job, fault, moment, epoch)
    return fault


def _etcd_restart(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    moment = time.monotonic()
    job.etcd.restart_all()
    fault = _fault(job, plan, moment, "all 3 members", ranks)
    fault.detail["etcd_s"] = time.monotonic() - moment
    _recovery(job, fault, moment, epoch)
    return fault


def _member_kill(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    index = chosen(range(job.etcd.size), plan.pick)
    leader = job.etcd.leader() == index
    if plan.flag and not leader:
        with contextlib.suppress(EtcdServerError):  # then a follower it is
            job.etcd.transfer_leadership(index, timeout=5.0)
            leader = True
    moment = time.monotonic()
    job.etcd.kill(index)
    what = f"m{index}{' (leader)' if leader else ''}"
    fault = _fault(job, plan, moment, what, ranks)
    _hold(job, plan.hold_s)
    job.etcd.restart(index)
    fault.detail["etcd_s"] = time.monotonic() - moment
    _recovery(job, fault, moment, epoch)
    return fault


def _quorum_loss(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    standby = job.standby
    if not job.standby_in_outages and standby is not None and standby.proc.poll() is None:
        # --no-standby-in-outages: no standby that could take the job over as etcd comes
        # back with every lease expired (the case RingPolicy.adopt's outage hold is for).
        standby.stop()
        job.standby = None
    leader = job.etcd.leader()
    other = chosen([i for i in range(job.etcd.size) if i != leader], plan.pick)
    moment = time.monotonic()
    job.etcd.stop(leader)
    job.etcd.stop(other)
    try:
        _hold(job, plan.hold_s)
    finally:
        job.etcd.cont(leader)
        job.etcd.cont(other)
    fault = _fault(job, plan, moment, f"m{leader} (leader) and m{other}", ranks)
    whole = poll_until(job.etcd.whole, ETCD_LIMIT_S)
    if whole is None:
        fault.problem = f"etcd not whole {ETCD_LIMIT_S:.0f} s after the outage"
    else:
        fault.detail["etcd_s"] = time.monotonic() - moment
    fault.detail["outage_s"] = plan.hold_s
    _recovery(job, fault, moment, epoch)
    return fault


def _partition(job: SoakJob, plan: Plan, epoch: int, ranks: int) -> Fault:
    node = chosen(job.ring_nodes(), plan.pick)
    host = node.host
    moment = time.monotonic()
    host.link_down()
    node.state = "cut"
    fault = _fault(job, plan, moment, f"{host.name} ({node.slot})", ranks)
    try:
        _recovery(job, fault, moment, epoch + 1, without=node.slot)
        fenced = poll_until(lambda: job.training_pid(node) is None, FENCE_LIMIT_S + 4.0)
        if fenced is None:
            fault.problem = (
                f"{host.name}'s rank still ran {FENCE_LIMIT_S + 4.0:.0f} s after the cut"
            )
        else:
            fault.detail["fenced_s"] = time.monotonic() - moment
        _hold(job, max(0.0, moment + plan.hold_s - time.monotonic()))
    finally:
        host.link_up()
        node.state = "active"
    fault.detail["cut_s"] = time.monotonic() - moment
    return fault


_MAKERS: Final[dict[str, Callable[[SoakJob, Plan, int, int], Fault]]] = {
    "kill": _kill,
    "stop": _stop,
    "leave": _leave,
    "join": _join,
    "takeover": _takeover,
    "adopt": _adopt,
    "etcd_restart": _etcd_restart,
    "member_kill": _member_kill,
    "quorum_loss": _quorum_loss,
    "partition": _partition,
}
