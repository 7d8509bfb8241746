"""Item 9: partition recovery and throughput on test hosts (issue #11).

Test hosts (tests/helpers/testhosts.py) are network namespaces on one bridge, each with its own
address and link. Host 0 runs ``elastic-run run --host H0 --workers 0`` (the launcher and its
private etcd), hosts 1-3 each a bare ``elastic-run join``: one training process per host
(bench/scripts/hvd_steps.py, ~100 k parameters, as items 2-4), ``--lease-ttl 3``.

* recovery: a fault schedule on the host of rank 1 of the running 3-rank ring, alternating
  ``kill`` (SIGKILL of its training process) and ``cut`` (its link down: a pulled cable), in one
  job. Each is timed like item 2: from the fault until every survivor printed a step at size 2.
  A cut host sends nothing and fails nothing: it is noticed when its leases expire, so the
  lease TTL is the floor of a cut; the issue bounds it by TTL + 1 s. The link stays down until
  the cut host has stopped its training process (fenced), then comes back; the next fault waits
  until the host is back in the ring (all 3 stepping at size 3).
* throughput: rank 0's steps/s at 3 ranks on test hosts vs the same job on loopback
  (``elastic-run run --workers 3``), alternating rounds (a fresh job each, the order swaps every
  round); the first test-hosts job then runs the fault schedule.

Where test hosts cannot be made (not root, no iproute2), the item says why and is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.horovodrun_baseline import MANY_STEPS, WORKLOAD
from bench.items.context import Context
from bench.jobs import (
    ELASTIC_RUN,
    STARTUP_LIMIT_S,
    BenchError,
    LineJob,
    Record,
    first_steps,
    log,
    process_tree,
    start_lines,
    step_rate,
    summarize,
)
from tests.helpers import testhosts
from tests.helpers.testhosts import Host, TestHosts

PARAMS = 100_000  # as items 2-4
WORKERS = 3
#: ``--lease-ttl`` of every job here (the default): a cut host is noticed this long after its
#: leases' last renewal, so it is the floor of a partition's recovery.
LEASE_TTL_S = 3
#: The issue's bound for a cut link: lease TTL + 1 s (cut -> the survivors step again).
TARGET_S = LEASE_TTL_S + 1.0
WARMUP_STEPS = 20
RECOVERY_LIMIT_S = 60.0
BACK_LIMIT_S = 180.0  # a restarted or re-registered node imports TensorFlow cold
#: How long a cut host may keep its training process (the multi-host test allows the same).
FENCE_LIMIT_S = 2 * LEASE_TTL_S + 2.0
#: What a node's agent logs when, cut off from etcd past its lease TTL, it stops its training
#: processes at once (launcher/node/agent.py, ``Agent._fence``).
FENCED = "cut off from etcd: no lease renewal"
_JOIN_LINE = re.compile(r"other hosts join with: elastic-run join --etcd (\S+) --job-id (\S+)")


def _job_flags(job_id: str, max_restarts: int) -> list[str]:
    """The job options both sides share (min 2: a lost node shrinks the ring, as in the test)."""
    return [
        *("--job-id", job_id, "--min-workers", "2", "--max-workers", str(WORKERS)),
        *("--lease-ttl", str(LEASE_TTL_S), "--max-restarts", str(max_restarts)),
        *("--", "python", str(WORKLOAD), "--steps", str(MANY_STEPS), "--params", str(PARAMS)),
    ]


def _poll_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` s (for states no output line shows:
    processes in a namespace)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def _empty(host: Host) -> bool:
    return not host.pids()


def _training_pids(host: Host) -> list[int]:
    """The training processes running on ``host``."""
    found = []
    for pid in host.pids():
        with contextlib.suppress(OSError):
            if WORKLOAD.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


class HostsJob(LineJob):
    """One job over test hosts: the launcher on host 0, a bare ``elastic-run join`` on each other.

    The joins' output is merged into this job's records; :attr:`host_of` says which host each
    slot runs on. Leaving it stops every process and waits until the hosts run none.
    """

    def __init__(self, hosts: TestHosts, job_id: str, max_restarts: int) -> None:
        self.hosts = hosts
        self.host_of: dict[str, str] = {}  # slot -> host name
        self.notes: list[tuple[float, str, str]] = []  # (arrived, host, line): the joins' logs
        self.joins: list[subprocess.Popen[str]] = []
        self.etcd: str | None = None
        launcher = hosts[0]
        super().__init__(
            launcher.command(
                [
                    *(ELASTIC_RUN, "run", "--host", launcher.ipv4, "--workers", "0"),
                    *_job_flags(job_id, max_restarts),
                ]
            )
        )
        try:
            self.wait_for(lambda: self.etcd is not None, STARTUP_LIMIT_S, "the join line")
            for host in list(hosts)[1:]:
                self._join(host, job_id)
        except BaseException:
            self.stop()
            raise

    def parse(self, line: str, arrived: float) -> Record | None:
        match = _JOIN_LINE.search(line)
        if match is not None:
            self.etcd = match.group(1)
        return super().parse(line, arrived)

    def _join(self, host: Host, job_id: str) -> None:
        assert self.etcd is not None
        proc = start_lines(
            host.command([ELASTIC_RUN, "join", "--etcd", self.etcd, "--job-id", job_id])
        )
        self.joins.append(proc)
        reader = threading.Thread(target=self._read_join, args=(host.name, proc), daemon=True)
        reader.start()

    def _read_join(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            arrived = time.monotonic()
            line = raw.rstrip("\n")
            record = self.parse(line, arrived)
            with self._cond:
                if record is None:
                    self.tail.append(f"[{name}] {line}")
                    self.notes.append((arrived, name, line))
                else:
                    self.host_of[record.source] = name
                    self.records.append(record)
                self._cond.notify_all()

    def host_key(self, record: Record) -> str | None:
        """The host a record's slot runs on (call under the lock, as first_steps does)."""
        return self.host_of.get(record.source)

    def join_pids(self) -> tuple[int, ...]:
        """The joins and everything they run (their training processes included)."""
        return tuple(pid for proc in self.joins for pid in process_tree(proc.pid))

    def stop(self) -> None:
        """SIGTERM the joins and the launcher together, SIGKILL what is left, empty the hosts."""
        for proc in self.joins:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        super().stop()
        for proc in self.joins:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for host in self.hosts:  # anything that outlived its parent, before the next job
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not _poll_until(functools.partial(_empty, host), 10.0):
                log(f"multihost: processes left on {host.name}: {host.pids()}")


def _warm_ring(job: HostsJob, since: float) -> str:
    """Wait until every worker host's rank printed WARMUP_STEPS steps at size 3 after ``since``;
    the host of rank 1 (the host item 2's faults would hit)."""
    counts: dict[str, int] = {}
    rank1: list[str] = []
    mark = 0

    def warm() -> bool:
        nonlocal mark
        for record in job.records[mark:]:
            if record.arrived > since and record.event == "step" and record.data.get("size") == 3:
                host = job.host_key(record)
                if host is not None:
                    counts[host] = counts.get(host, 0) + 1
                    if record.data.get("rank") == 1:
                        rank1[:] = [host]
        mark = len(job.records)
        return len(counts) == WORKERS and min(counts.values()) >= WARMUP_STEPS and bool(rank1)

    job.wait_for(warm, STARTUP_LIMIT_S, f"{WORKERS} hosts to warm up at size 3 (got {counts})")
    return rank1[0]


def _fenced(job: HostsJob, name: str, hit_at: float) -> float | None:
    """Seconds from the cut until host ``name``'s agent logged that it stops its training
    process (it fences itself once cut off from etcd for the lease TTL); None if it did not
    within FENCE_LIMIT_S, or if a training process still ran there 2 s later."""
    found: list[float] = []

    def logged() -> bool:
        found[:] = [
            t for t, host, line in job.notes if t > hit_at and host == name and FENCED in line
        ]
        return bool(found)

    try:
        job.wait_for(logged, FENCE_LIMIT_S - (time.monotonic() - hit_at), f"{name} to fence")
    except BenchError as exc:
        log(f"multihost: {exc}")
        return None
    host = next(h for h in job.hosts if h.name == name)
    if not _poll_until(lambda: not _training_pids(host), 2.0):
        log(f"multihost: {name} still runs {_training_pids(host)} after it fenced")
        return None
    return found[0] - hit_at


def _fault(job: HostsJob, kind: str, since: float) -> tuple[dict[str, Any], float]:
    """One fault on the host of rank 1 of the running ring, until it is back at size 3.

    ``since``: the ring must be stepping at size 3 after this time. Returns the figures and the
    time every host stepped at size 3 again.
    """
    name = _warm_ring(job, since)
    host = next(h for h in job.hosts if h.name == name)
    everyone = {h.name for h in list(job.hosts)[1:]}
    survivors = everyone - {name}
    fenced: float | None = None
    if kind == "kill":
        pids = _training_pids(host)
        if len(pids) != 1:
            raise BenchError(f"expected one training process on {name}, found {pids}")
        hit_at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
    else:
        hit_at = time.monotonic()
        host.link_down()
    try:
        first = first_steps(
            job, hit_at, 2, members=survivors, key=job.host_key, timeout=RECOVERY_LIMIT_S
        )
        if kind == "cut":  # keep the cable out until the cut host has stopped its rank
            fenced = _fenced(job, name, hit_at)
    finally:
        back_from = time.monotonic()
        if kind == "cut":
            host.link_up()
    recovered = max(first.values())
    back = first_steps(job, recovered, 3, members=everyone, key=job.host_key, timeout=BACK_LIMIT_S)
    result = {
        "kind": kind,
        "host": name,
        "recovery_s": recovered - hit_at,
        # cut: until the cut host's agent logged that it stops its training process (it fences
        # itself once cut off from etcd for the lease TTL); kill: None.
        "fenced_s": fenced,
        # kill: from the SIGKILL, the restarted process a new rank; cut: from the link's
        # return, the host registered again and its new process a rank.
        "back_s": max(back.values()) - (hit_at if kind == "kill" else back_from),
    }
    log(f"multihost fault: {result}")
    return result, max(back.values())


def _faults(job: HostsJob, schedule: list[str]) -> list[dict[str, Any]]:
    """The fault schedule in one job; stops at the first failed trial (the job's state is then
    unknown: later trials would not measure what they say)."""
    results: list[dict[str, Any]] = []
    since = 0.0
    for kind in schedule:
        try:
            result, since = _fault(job, kind, since)
        except (BenchError, testhosts.TestHostsError) as exc:
            log(f"multihost {kind} trial failed: {exc}")
            results.append({"kind": kind, "error": str(exc)})
            break
        results.append(result)
    return results


def _rate(
    job: LineJob, seconds: float, settle_s: float, extra: Callable[[], tuple[int, ...]]
) -> dict[str, float] | None:
    """Rank 0's steps/s at 3 ranks (and CPU), or None when the job failed."""
    try:
        job.wait_for(
            lambda: (
                sum(
                    1
                    for r in job.records
                    if r.event == "step"
                    and r.data.get("rank") == 0
                    and r.data.get("size") == WORKERS
                )
                >= WARMUP_STEPS
            ),
            STARTUP_LIMIT_S,
            f"rank 0 to warm up at {WORKERS}",
        )
        return step_rate(job, seconds, WORKERS, settle_s=settle_s, extra_pids=extra())
    except BenchError as exc:
        log(f"multihost: a throughput round failed: {exc}")
        return None


def _values(rows: list[dict[str, float] | None], name: str) -> list[float | None]:
    return [None if row is None else row[name] for row in rows]


def run(ctx: Context) -> dict[str, Any]:
    reason = testhosts.available()
    if reason is not None:
        return {"skipped": f"test hosts cannot be made here: {reason}"}
    schedule = ctx.pick(["kill", "cut"], ["kill", "cut"] * 5)
    rounds = ctx.pick(1, 3)
    seconds = ctx.pick(5.0, 15.0)
    settle_s = ctx.pick(2.0, 3.0)
    on_hosts: list[dict[str, float] | None] = []
    on_loopback: list[dict[str, float] | None] = []
    faults: list[dict[str, Any]] = []
    hosts = TestHosts(1 + WORKERS)
    hosts.start()
    try:
        for round_ in range(rounds):
            for side in ("hosts", "loopback")[:: 1 if round_ % 2 == 0 else -1]:
                try:
                    if side == "loopback":
                        with LineJob(
                            [
                                *(ELASTIC_RUN, "run", "--workers", str(WORKERS)),
                                *_job_flags(ctx.job_id("multihost-lo"), 0),
                            ]
                        ) as job:
                            on_loopback.append(_rate(job, seconds, settle_s, lambda: ()))
                        continue
                    restarts = len(schedule) + 2 if round_ == 0 else 0
                    hosts_job = HostsJob(hosts, ctx.job_id("multihost"), restarts)
                    with hosts_job:
                        on_hosts.append(_rate(hosts_job, seconds, settle_s, hosts_job.join_pids))
                        if round_ == 0:
                            faults = _faults(hosts_job, schedule)
                except BenchError as exc:  # a job that did not start: this round has no figure
                    log(f"multihost: the {side} job of round {round_} failed: {exc}")
                    (on_loopback if side == "loopback" else on_hosts).append(None)
                    if side == "hosts" and round_ == 0:
                        faults = [{"kind": schedule[0], "error": str(exc)}]
            log(f"multihost round {round_}: test hosts {on_hosts[-1]}, loopback {on_loopback[-1]}")
    finally:
        try:
            hosts.close()
        except testhosts.TestHostsError as exc:
            log(f"multihost: {exc}")
    cut = summarize([f.get("recovery_s") for f in faults if f["kind"] == "cut"])
    kill = summarize([f.get("recovery_s") for f in faults if f["kind"] == "kill"])
    a, b = _values(on_hosts, "steps_per_s"), _values(on_loopback, "steps_per_s")
    done_a, done_b = [v for v in a if v is not None], [v for v in b if v is not None]
    ratio = statistics.median(done_a) / statistics.median(done_b) if done_a and done_b else None
    return {
        "params": PARAMS,
        "hosts": f"1 launcher host + {WORKERS} worker hosts joined bare, one training process each",
        "lease_ttl_s": LEASE_TTL_S,
        "faults": faults,
        "partition": {
            "what": "link of rank 1's host cut -> every survivor completed a step at size 2 (s)",
            "elastic_run": cut,
            # SIGKILL of rank 1's training process in the same job, on the same hosts.
            "crash": kill,
            "fenced": summarize([f.get("fenced_s") for f in faults if f["kind"] == "cut"]),
            "rejoin": summarize([f.get("back_s") for f in faults if f["kind"] == "cut"]),
            "crash_back": summarize([f.get("back_s") for f in faults if f["kind"] == "kill"]),
            "floor_s": LEASE_TTL_S,
            "target_s": TARGET_S,
            "met": cut.get("max", float("inf")) <= TARGET_S,
        },
        "throughput": {
            "what": f"steps/s of rank 0 at {WORKERS} ranks, ~{PARAMS:,} parameters, same script "
            "and job options",
            "rounds": rounds,
            "seconds_per_round": seconds,
            "test_hosts": summarize(a),
            "loopback": summarize(b),
            "ratio": ratio,
            "round_ratios": [x / y for x, y in zip(a, b, strict=True) if x and y],
            "cpu": {
                "test_hosts_workers": summarize(_values(on_hosts, "workers_cpu")),
                "test_hosts_others": summarize(_values(on_hosts, "others_cpu")),
                "loopback_workers": summarize(_values(on_loopback, "workers_cpu")),
                "loopback_others": summarize(_values(on_loopback, "others_cpu")),
            },
        },
    }
