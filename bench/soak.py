"""`make soak`: a seeded random schedule of faults, of every kind, against one real job.

The job is the CNN digits example (examples/cnn_digits.py: exactly-once data, a fixed global
batch, the sample audit) on test hosts (tests/helpers/testhosts.py: network namespaces on one
bridge, so root only): host h1 runs a 3-member etcd cluster, the leading launcher and a standby
launcher; worker hosts h2..h7 each run at most one bare ``elastic-run join`` node (one training
process each). The same job runs twice on the same hosts and etcd: clean (no fault), then under
the schedule. The fault kinds, each about equally often, in a seeded order:

- ``kill``: SIGKILL of a training process (the launcher restarts it);
- ``stop``: SIGSTOP of a training process; half the time SIGCONT after 0.2-0.35 s (a stall),
  else held until its agent kills it (a hang), then SIGCONT;
- ``leave``: SIGTERM of an agent, whose node leaves gracefully;
- ``join``: ``elastic-run join`` of a new node on a free host;
- ``takeover``: SIGKILL of the leading launcher; the standby takes the job over;
- ``adopt``: the standby stopped, the leader SIGKILLed and the same ``run`` command started
  again 4-5.5 s later (past the lease TTL), which adopts the job;
- ``etcd_restart``: every etcd member stopped (SIGTERM), then all started again;
- ``member_kill``: SIGKILL of one etcd member (half the time the leader), restarted 2-6 s later;
- ``quorum_loss``: two members (the leader and one more) SIGSTOPped for 18-22 s, then SIGCONTed
  (the standby stays: it may take the job over as etcd returns, every lease expired, and
  must wait for the ring's nodes; ``--no-standby-in-outages`` stops it before and starts it after);
- ``partition``: a worker host's link cut (a pulled cable) for 5-8 s (at least until
  its rank stopped): its node fences itself
  and rejoins once the link is back.

The job is kept healthy between faults: each fault first waits until every rank of the newest
ring steps, at least 2 of them; after it the pool is topped up to 3 nodes with new joins and a
new standby replaces one that took over; every etcd member runs again before the next fault. A
fault takes one rank of a ring whose every rank has synced, so the committed state always
survives (``--min-workers 1``: the survivors re-form at once, whatever their number). Fault i
waits until the job has trained i/N of 85 % of its epochs, so the faults are spread over the
run and the job keeps epochs in hand for a schedule that falls behind.

Recovery of a fault: from the fault until every rank of a ring has stepped again (printed two
audit lines after it). For faults that change the ring (kill, hang, leave, join, partition) the
ring must be one formed after the fault (for a join one that holds the new node, for a leave or
cut one without the node); for the others (a stall, launcher and etcd faults, through which
training goes on) any ring.

Writes bench/results/soak.json, the "Soak" section of bench/RESULTS.md (bench/soak_report.py)
and every output line of both jobs to bench/results/soak.log. Everything it starts -- the
namespaces, every process, the etcd data, the audit logs -- is removed at the end, also on a
failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import FrameType
from typing import IO, Any, Final, TypeVar, cast

from bench import soak_report
from bench.jobs import ELASTIC_RUN, ROOT, process_tree, summarize
from elastic_allreduce import env
from elastic_allreduce.errors import EtcdServerError
from elastic_allreduce.store.embedded import free_port
from elastic_allreduce.training import audit
from tests.helpers import testhosts
from tests.helpers.etcd_cluster import START_TIMEOUT, ClusterMember, EtcdCluster
from tests.helpers.testhosts import Host, TestHosts

T = TypeVar("T")

SCRIPT: Final = ROOT / "examples" / "cnn_digits.py"
RESULTS_DIR: Final = ROOT / "bench" / "results"
#: Worker hosts h2..h7: at most MAX_NODES hold a node, the others are free for joins.
WORKER_HOSTS: Final = 6
POOL: Final = 3  # nodes the pool is topped up to after each fault
MAX_NODES: Final = 4  # --max-workers
LEASE_TTL: Final = 3
#: Data epochs of the job per planned fault: the job must outlast the schedule (at 6.5 the
#: replay of seed 11734 ran out of epochs at fault 98: its faults fell behind the epochs).
EPOCHS_PER_FAULT: Final = 8
#: The share of the epochs the faults are spread over; the rest is slack for a schedule that
#: falls behind the epochs (each fault also waits for its recovery and the upkeep).
SPREAD: Final = 0.85
MIN_EPOCHS: Final = 20
#: Standbys started for a takeover fault before the soak gives up (one that took the job over
#: unasked, as etcd returned, is replaced).
STANDBY_TRIES: Final = 3
#: How long a fault that needs a training process of the newest ring waits for one.
VICTIM_LIMIT_S: Final = 60.0
GLOBAL_BATCH: Final = 64  # cnn_digits.py's default

KINDS: Final = (
    "kill",
    "stop",
    "leave",
    "join",
    "takeover",
    "adopt",
    "etcd_restart",
    "member_kill",
    "quorum_loss",
    "partition",
)
ETCD_KINDS: Final = frozenset({"etcd_restart", "member_kill", "quorum_loss"})

READY_LIMIT_S: Final = 300.0  # the first nodes import TensorFlow cold, all at once
HEALTH_LIMIT_S: Final = 300.0  # before a fault: the ring back at the ranks it needs
RECOVERY_LIMIT_S: Final = 180.0
JOIN_LIMIT_S: Final = 300.0  # a joining node imports TensorFlow cold on a busy machine
LAUNCHER_LIMIT_S: Final = 120.0
LEAVE_LIMIT_S: Final = 90.0  # the agent's own leave timeout is 60 s
ETCD_LIMIT_S: Final = 60.0
END_LIMIT_S: Final = 1800.0  # the job's end after its last fault
HANG_KILL_LIMIT_S: Final = 10.0  # a stopped process is killed by its agent after 0.5 s
FRESH_S: Final = 5.0  # a rank whose last audit line is older does not step
AUDIT_POLL_S: Final = 0.05
POLL_S: Final = 0.1
#: A cut host must have stopped its training processes by then (2 x TTL + 2 s, as tested).
FENCE_LIMIT_S: Final = 2 * LEASE_TTL + 2.0
CLONE_NEWNET: Final = 0x40000000
#: The agents' snapshot folders (ELASTIC_ALLREDUCE_SNAPSHOT_ROOT, shared memory): one root for
#: the soak's jobs, removed at the end (an agent removes its own folders only when it exits).
SNAPSHOT_ROOT: Final = Path(f"/dev/shm/elastic-allreduce-soak-{os.getpid()}")  # noqa: S108

_RING_RUNNING = re.compile(r"\bepoch (\d+) running with (\d+) ranks")
_RING_TAKEN = re.compile(r"took over ring epoch (\d+) \(running, (\d+) ranks")
_ACCURACY = re.compile(r"final test accuracy: ([0-9.]+)")
_FINAL = re.compile(r"\bjob \S+ (succeeded|failed): ")
_CRASH = re.compile(r"\bslot \S+ crashed: ([^;]+?)(?:; |$)")


def say(message: str) -> None:
    """One line of the soak's own progress, on stdout."""
    print(f"[soak {datetime.now(UTC):%H:%M:%S}] {message}", flush=True)


class SoakError(RuntimeError):
    """The soak cannot go on: the job did not come back, ended early or failed."""


def poll_until(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``predicate()`` held (checked every POLL_S), or None after ``timeout`` s:
    for states that no output line shows (processes, etcd members)."""
    started = time.monotonic()
    pause = threading.Event()
    while not predicate():
        if time.monotonic() - started >= timeout:
            return None
        pause.wait(POLL_S)
    return time.monotonic() - started


# -- the schedule ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One fault of the schedule; every random choice is drawn from the seed up front."""

    index: int
    kind: str
    pick: float  #: chooses the victim among the candidates (sorted by name) at fault time
    hold_s: float  #: a stall's, a member's downtime's, an outage's or a cut's length
    flag: bool  #: stop: a stall (else a hang); member_kill: the leader
    gap_s: float  #: training time after the previous fault's recovery, at least


def schedule(seed: int, count: int) -> list[Plan]:
    """``count`` faults: every kind equally often (the remainder drawn), shuffled."""
    rng = random.Random(seed)
    kinds = list(KINDS) * (count // len(KINDS)) + rng.sample(KINDS, count % len(KINDS))
    rng.shuffle(kinds)
    plans = []
    for index, kind in enumerate(kinds, 1):
        flag = rng.random() < 0.5
        holds = {
            "stop": (0.2, 0.35),
            "adopt": (4.0, 5.5),  # past the lease TTL: before, `run` refuses (a live leader)
            "member_kill": (2.0, 6.0),
            "quorum_loss": (18.0, 22.0),
            "partition": (5.0, 8.0),
        }
        hold = rng.uniform(*holds[kind]) if kind in holds else 0.0
        plans.append(Plan(index, kind, rng.random(), hold, flag, rng.uniform(0.5, 2.0)))
    return plans


def chosen(items: Sequence[T], pick: float) -> T:
    """The item that ``pick`` (in [0, 1)) falls on."""
    return items[min(int(pick * len(items)), len(items) - 1)]


# -- this process in a test host's network namespace -------------------------------------------


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET): {os.strerror(errno)}")


@contextlib.contextmanager
def inside(host: Host) -> Iterator[None]:
    """Run this process's main thread -- and the threads and children it starts meanwhile -- in
    ``host``'s network namespace, where the etcd cluster listens; back in its own after, so
    that the test hosts' cleanup (which kills every process in their namespaces) spares it."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{host.ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


# -- the etcd cluster on host 0 ----------------------------------------------------------------


class _Member(ClusterMember):
    """A cluster member on a test host's address (worker hosts reach it), not loopback."""

    def __init__(
        self, address: str, name: str, data_dir: Path, ports: tuple[int, int], cluster: str
    ) -> None:
        super().__init__(name, data_dir, ports[0], ports[1], cluster)
        self.host = address


class HostEtcd(EtcdCluster):
    """tests/helpers/etcd_cluster.py's 3 members, on one test host's address."""

    def __init__(self, address: str, base_dir: Path) -> None:
        super().__init__(3, base_dir=base_dir)
        self.address = address

    def _make_members(self) -> None:
        names = [f"m{index}" for index in range(self.size)]
        ports = {name: (free_port(self.address), free_port(self.address)) for name in names}
        cluster = ",".join(f"{n}=http://{self.address}:{ports[n][1]}" for n in names)
        for name in names:
            shutil.rmtree(self.base_dir / name, ignore_errors=True)
        self.members = [
            _Member(self.address, name, self.base_dir / name, ports[name], cluster)
            for name in names
        ]

    def whole(self) -> bool:
        """Whether every member runs, answers, and all follow one leader."""
        leaders = set()
        for member in self.members:
            status = None if member.pid is None or member.stopped else member.status()
            if status is None:
                return False
            leaders.add(str(status.get("leader", "0")))
        return len(leaders) == 1 and "0" not in leaders

    def restart_all(self) -> None:
        """Stop every member (SIGTERM), start them all again, wait until each is healthy."""
        for member in self.members:
            member.stop()
        for member in self.members:
            member.spawn()
        for member in self.members:
            member.wait_healthy(START_TIMEOUT)


# -- what the job does, seen from outside ------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One audit line (ELASTIC_ALLREDUCE_SAMPLE_LOG): a rank about to run a step."""

    arrived: float
    slot: str
    ring: int
    epoch: int
    step: int
    rank: int


class Tracker:
    """Every output line of the job's processes and every audit line of its ranks, with the
    moment each reached the soak, and the ring epochs the launchers announced."""

    def __init__(self, audit_dir: Path, log: IO[str]) -> None:
        self.audit_dir = audit_dir
        self.log = log
        self.cond = threading.Condition()
        self.steps: list[Step] = []
        self.by_ring: dict[int, dict[int, list[float]]] = {}  # ring -> rank -> arrivals
        self.ring_slots: dict[int, set[str]] = {}
        self.rings: dict[int, int] = {}  # ring epoch -> ranks, as a launcher announced it
        self.ring_at: dict[int, float] = {}  # ... and when
        self.lines: dict[str, list[tuple[float, str]]] = {}
        self.max_epoch = -1
        self.final: str | None = None  # the leader's last word: "job J succeeded: ..."
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="audit", daemon=True)
        self._poller.start()

    def close(self) -> None:
        """Stop polling (after one last read)."""
        if not self._stop.is_set():
            self._stop.set()
            self._poller.join(timeout=5)
            self._read_audit()

    # -- inputs --------------------------------------------------------------------------------

    def follow(self, who: str, proc: subprocess.Popen[str]) -> None:
        """Read ``proc``'s output lines, as ``who``, in a thread of their own."""

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                self._line(who, raw.rstrip("\n"))
            self._line(who, f"(exited with {proc.wait()})")

        threading.Thread(target=pump, name=f"out-{who}", daemon=True).start()

    def _line(self, who: str, text: str) -> None:
        now = time.monotonic()
        match = final = None
        if who.startswith("launcher"):
            match = _RING_RUNNING.search(text) or _RING_TAKEN.search(text)
            final = _FINAL.search(text)
        with self.cond:
            self.lines.setdefault(who, []).append((now, text))
            if match is not None and int(match.group(1)) not in self.rings:
                self.rings[int(match.group(1))] = int(match.group(2))
                self.ring_at[int(match.group(1))] = now
            if final is not None and self.final is None:
                self.final = text
            self.log.write(f"{now:.3f} [{who}] {text}\n")
            self.cond.notify_all()

    def _poll(self) -> None:
        while not self._stop.wait(AUDIT_POLL_S):
            self._read_audit()

    def _read_audit(self) -> None:
        new: list[Step] = []
        now = time.monotonic()
        for path in sorted(self.audit_dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as file:
                    file.seek(offset)
                    chunk = file.read()
            except OSError:
                continue
            if not chunk:
                continue
            self._offsets[path] = offset + len(chunk)
            *complete, rest = (self._partial.pop(path, b"") + chunk).split(b"\n")
            if rest:
                self._partial[path] = rest
            for raw in complete:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    line = json.loads(raw)
                    fields = (int(line[k]) for k in ("ring", "epoch", "step", "rank"))
                    new.append(Step(now, path.stem, *fields))
        if not new:
            return
        with self.cond:
            for step in new:
                self.steps.append(step)
                self.by_ring.setdefault(step.ring, {}).setdefault(step.rank, []).append(now)
                self.ring_slots.setdefault(step.ring, set()).add(step.slot)
                self.max_epoch = max(self.max_epoch, step.epoch)
            self.cond.notify_all()

    # -- questions: call them under ``cond`` (``wait`` does) -----------------------------------

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Whether ``predicate`` (evaluated under the lock) came true within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.25))
            return True

    def saw(self, who: str, needle: str, after: float = 0.0) -> float | None:
        """When ``who`` first printed a line holding ``needle`` after ``after``."""
        for at, text in self.lines.get(who, []):
            if at >= after and needle in text:
                return at
        return None

    def latest_ring(self) -> int:
        return max(self.rings, default=0)

    def stepping_since(self, epoch: int, after: float) -> float | None:
        """When every rank of ring ``epoch`` had printed two audit lines after ``after``."""
        lines = self.by_ring.get(epoch, {})
        moments = []
        for rank in range(self.rings[epoch]):
            times = [t for t in lines.get(rank, []) if t >= after]
            if len(times) < 2:
                return None
            moments.append(times[1])
        return max(moments, default=None)

    def recovered(
        self, after: float, min_epoch: int, *, need: str | None = None, without: str | None = None
    ) -> float | None:
        """When the first ring from ``min_epoch`` on -- holding slot ``need``, not holding
        ``without`` -- had every rank stepping after ``after``; None if none has yet."""
        best = None
        for epoch in self.rings:
            slots = self.ring_slots.get(epoch, set())
            if epoch < min_epoch or (need is not None and need not in slots):
                continue
            if without is not None and without in slots:
                continue
            moment = self.stepping_since(epoch, after)
            if moment is not None and (best is None or moment < best):
                best = moment
        return best

    def healthy(self, min_ranks: int) -> bool:
        """Whether every rank of the newest ring steps now, and it has at least ``min_ranks``."""
        epoch = self.latest_ring()
        if self.rings.get(epoch, 0) < min_ranks:
            return False
        now = time.monotonic()
        lines = self.by_ring.get(epoch, {})
        return all(
            len(lines.get(rank, [])) >= 2 and now - lines[rank][-1] <= FRESH_S
            for rank in range(self.rings[epoch])
        )

    def ring_members(self) -> list[str]:
        """The slots of the newest ring (those that printed a step in it), sorted."""
        return sorted(self.ring_slots.get(self.latest_ring(), set()))

    def texts(self, prefix: str) -> list[str]:
        """Every line printed by the processes whose name starts with ``prefix``."""
        with self.cond:
            return [
                t for who, lines in self.lines.items() if who.startswith(prefix) for _, t in lines
            ]


def crash_causes(launcher_lines: Sequence[str]) -> dict[str, int]:
    """How many training processes the launchers reported crashed, by cause ("killed by
    SIGKILL": the soak's kills and the agents' kills of stopped processes; anything else was
    not the soak's doing)."""
    causes: dict[str, int] = {}
    for text in launcher_lines:
        match = _CRASH.search(text)
        if match is not None and "last output" not in match.group(1):
            causes[match.group(1)] = causes.get(match.group(1), 0) + 1
    return causes


def goodput(steps: Sequence[Step]) -> dict[str, Any]:
    """Time in the steps that were kept over the training time (first to last audit line).

    A step is kept when its ring epoch is the highest that ran it (as the audit decides); its
    time is from rank 0's audit line to rank 0's next line in the same ring (the last step of
    a ring before it ended counts nothing). Time that is not kept: rolled-back steps, re-forms,
    syncs, outages that stopped training, and the end-of-epoch evaluation of rank 0.
    """
    if not steps:
        return {"goodput": None}
    applied: dict[tuple[int, int], int] = {}
    for s in steps:
        applied[(s.epoch, s.step)] = max(applied.get((s.epoch, s.step), s.ring), s.ring)
    runs: dict[tuple[str, int], list[Step]] = {}
    for s in steps:
        runs.setdefault((s.slot, s.ring), []).append(s)
    kept = 0.0
    for run in runs.values():
        for a, b in itertools.pairwise(run):
            if a.rank == 0 and applied[(a.epoch, a.step)] == a.ring:
                kept += b.arrived - a.arrived
    span = max(s.arrived for s in steps) - min(s.arrived for s in steps)
    return {
        "goodput": kept / span if span > 0 else None,
        "kept_step_s": kept,
        "training_s": span,
        "steps_kept": len(applied),
        "steps_run": len({(s.epoch, s.step, s.ring) for s in steps}),
    }


# -- one job on the test hosts -----------------------------------------------------------------


@dataclass(eq=False)
class Launcher:
    name: str
    proc: subprocess.Popen[str]


@dataclass(eq=False)
class Node:
    host: Host
    proc: subprocess.Popen[str]
    state: str = "active"  # active, leaving, cut, gone

    @property
    def node_id(self) -> str:
        return f"j{self.proc.pid}"  # `elastic-run join`'s own default (ip netns exec execs it)

    @property
    def slot(self) -> str:
        return f"{self.node_id}.0"


@dataclass
class Fault:
    """What one fault did and when the job stepped again."""

    index: int
    kind: str
    at_s: float  #: since the soak job started
    target: str
    ranks_before: int
    recovery_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    waited_s: float = 0.0  #: since the previous fault was over: training, health, upkeep


class SoakJob:
    """One run of the CNN digits job on the test hosts: a leader and a standby launcher on host
    0, joined nodes on the worker hosts; then the faults of a schedule, with the upkeep."""

    def __init__(
        self,
        name: str,
        *,
        hosts: TestHosts,
        etcd: HostEtcd,
        workdir: Path,
        epochs: int,
        log: IO[str],
        standby_in_outages: bool = False,
    ) -> None:
        self.name = name
        self.standby_in_outages = standby_in_outages
        self.hosts = hosts
        self.etcd = etcd
        self.epochs = epochs
        self.job_id = f"soak-{name}-{os.getpid()}"
        self.audit_dir = workdir / f"audit-{name}"
        self.audit_dir.mkdir()
        tmp = workdir / f"tmp-{name}"  # the launchers' events files, anything else temporary
        tmp.mkdir()
        self.env = {
            **os.environ,
            env.SAMPLE_LOG: str(self.audit_dir),
            "TMPDIR": str(tmp),
            "ELASTIC_ALLREDUCE_SNAPSHOT_ROOT": str(SNAPSHOT_ROOT),
            "PYTHONUNBUFFERED": "1",
        }
        self.tracker = Tracker(self.audit_dir, log)
        self.launchers: list[Launcher] = []
        self.standby: Launcher | None = None
        self.leaderless = False  # an adoption's gap: no launcher runs, by design
        self.nodes: list[Node] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.faults: list[Fault] = []
        self.joining: list[tuple[Fault, float, int, Node]] = []
        self.upkeep = {"joins": 0, "leaves": 0, "standbys": 0}
        self.problems: list[str] = []
        self.started = time.monotonic()
        self.ended: float | None = None
        self._names = itertools.count(1)

    # -- processes ----------------------------------------------------------------------------

    def _popen(self, host: Host, argv: list[str]) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = host.popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # Ctrl-C reaches the soak only, which stops everything
        )
        self.procs.append(proc)
        return proc

    def _launcher_argv(self, standby: bool) -> list[str]:
        return [
            *(
                ELASTIC_RUN,
                "run",
                "--host",
                self.hosts[0].address(),
                "--etcd",
                self.etcd.endpoints_text,
            ),
            *("--job-id", self.job_id, "--workers", "0", "--min-workers", "1"),
            *("--max-workers", str(MAX_NODES), "--max-restarts", "100000"),
            *("--lease-ttl", str(LEASE_TTL), "--outage-timeout", "180"),
            *(["--standby"] if standby else []),
            *("--", "python", str(SCRIPT), "--epochs", str(self.epochs)),
        ]

    def _launch(self, standby: bool) -> Launcher:
        name = f"launcher{next(self._names)}"
        proc = self._popen(self.hosts[0], self._launcher_argv(standby))
        self.tracker.follow(name, proc)
        launcher = Launcher(name, proc)
        self.launchers.append(launcher)
        return launcher

    def start_node(self, host: Host) -> Node:
        argv = [ELASTIC_RUN, "join", "--etcd", self.etcd.endpoints_text, "--job-id", self.job_id]
        node = Node(host, self._popen(host, argv))
        self.tracker.follow(f"node-{node.node_id}@{host.name}", node.proc)
        self.nodes.append(node)
        return node

    def registered(self, node: Node) -> None:
        """Wait until a new node is past `join`'s checks (it started its process) or ended: a
        launcher fault meanwhile would fail them (the rendezvous they check goes away)."""
        who = f"node-{node.node_id}@{node.host.name}"
        self.tracker.wait(
            lambda: (
                self.tracker.saw(who, "started incarnation") is not None
                or node.proc.poll() is not None
            ),
            LAUNCHER_LIMIT_S,
        )

    def pool(self) -> list[Node]:
        """The nodes that are in the job or will be again (a cut one): running, not leaving."""
        return [n for n in self.nodes if n.proc.poll() is None and n.state in ("active", "cut")]

    def free_hosts(self) -> list[Host]:
        busy = {n.host.name for n in self.nodes if n.proc.poll() is None}
        return [h for h in list(self.hosts)[1:] if h.name not in busy]

    def ring_nodes(self) -> list[Node]:
        """The active nodes whose slot is in the newest ring, by node id."""
        with self.tracker.cond:
            members = set(self.tracker.ring_members())
        found = [n for n in self.pool() if n.state == "active" and n.slot in members]
        return sorted(found, key=lambda n: n.node_id)

    def training_pid(self, node: Node) -> int | None:
        """The pid of ``node``'s training process (its environment names the slot)."""
        marker = f"{env.SLOT}={node.slot}".encode()
        for pid in node.host.pids():
            with contextlib.suppress(OSError):
                if b"elastic_allreduce.bootstrap" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
        return None

    def leader(self) -> Launcher:
        """The launcher that took the job over last; the first one leads from its start. (A
        standby also takes over on its own when etcd let the leader's lease expire.)"""
        with self.tracker.cond:
            led = [(0.0, self.launchers[0])]
            for launcher in self.launchers[1:]:
                at = self.tracker.saw(launcher.name, "taking over job")
                if at is not None:
                    led.append((at, launcher))
        return max(led, key=lambda pair: pair[0])[1]

    def job_over(self) -> bool:
        """Whether the leader said the job ended, or every launcher is gone (but in the gap of
        an adoption)."""
        with self.tracker.cond:
            if self.tracker.final is not None:
                return True
        return not self.leaderless and all(
            launcher.proc.poll() is not None for launcher in self.launchers
        )

    def _since(self, moment: float) -> float:
        return moment - self.started

    # -- start, upkeep, end -------------------------------------------------------------------

    def start(self, nodes: int = POOL) -> None:
        """The leader, a standby and ``nodes`` nodes; returns once every rank steps."""
        name = self._launch(standby=False).name
        if (
            not self.tracker.wait(
                lambda: (
                    self.tracker.saw(name, "other hosts join with") is not None or self.job_over()
                ),
                LAUNCHER_LIMIT_S,
            )
            or self.job_over()
        ):
            raise SoakError(f"{self.name}: the launcher did not start")
        self.ensure_standby()
        for host in list(self.hosts)[1 : 1 + nodes]:
            self.start_node(host)
        if not self.tracker.wait(lambda: self.tracker.healthy(nodes), READY_LIMIT_S):
            raise SoakError(f"{self.name}: no {nodes} ranks training within {READY_LIMIT_S:.0f} s")
        say(f"{self.name}: {nodes} ranks training ({self.job_id}, {self.epochs} epochs)")

    def ensure_standby(self) -> Launcher:
        """A standby launcher standing by (started if there is none). One started while etcd
        let the leader's lease expire takes the job over instead of standing by: then another
        is started."""
        for _ in range(STANDBY_TRIES):
            if self._needs_standby():
                self.standby = self._launch(standby=True)
                if self.faults:
                    self.upkeep["standbys"] += 1
            standby = self.standby
            assert standby is not None
            self.tracker.wait(partial(self._stood_by_or_took_over, standby), LAUNCHER_LIMIT_S)
            if standby.proc.poll() is not None:
                break
            if standby is self.leader():
                continue  # it took the job over unasked: another one stands by for the fault
            if self.tracker.saw(standby.name, "standing by") is not None:
                return standby
            break
        name = self.standby.name if self.standby is not None else "the standby"
        raise SoakError(f"{name} did not stand by within {LAUNCHER_LIMIT_S:.0f} s")

    def _stood_by_or_took_over(self, standby: Launcher) -> bool:
        return (
            self.tracker.saw(standby.name, "standing by") is not None
            or self.tracker.saw(standby.name, "taking over job") is not None
            or standby.proc.poll() is not None
        )

    def tend(self) -> None:
        """After a fault: note nodes that ended, top the pool up to POOL, a standby again."""
        for node in self.nodes:
            code = node.proc.poll()
            if code is None or node.state == "gone":
                continue
            if node.state != "leaving" and not self.job_over():
                self.problems.append(
                    f"node {node.node_id} on {node.host.name} exited with {code} unasked"
                )
            node.state = "gone"
        if self.job_over():
            return
        while len(self.pool()) < POOL and self.free_hosts():
            self.registered(self.start_node(self.free_hosts()[0]))
            self.upkeep["joins"] += 1
        if self._needs_standby():
            self.standby = self._launch(standby=True)
            self.upkeep["standbys"] += 1

    def _needs_standby(self) -> bool:
        standby = self.standby
        return standby is None or standby.proc.poll() is not None or standby is self.leader()

    def finish(self, timeout: float) -> int | None:
        """Wait for the job's end and every process's exit; the leader's exit code."""
        if not self.tracker.wait(self.job_over, timeout):
            self.problems.append(f"the job did not end within {timeout:.0f} s")
            return None
        self.ended = time.monotonic()
        leader = self.leader()
        try:
            code: int | None = leader.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, 60.0 - (time.monotonic() - self.ended)))
        left = [" ".join(cast(list[str], p.args)[3:6]) for p in self.procs if p.poll() is None]
        if left:
            self.problems.append(f"still running 60 s after the job ended: {left}")
        return code

    def stop(self) -> None:
        """Kill whatever this job started that still runs, and everything those started."""
        for proc in self.procs:
            if proc.poll() is None:
                for pid in reversed(process_tree(proc.pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for host in list(self.hosts)[1:]:  # only this job's processes run on worker hosts
            for pid in host.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.tracker.close()

    # -- the schedule -------------------------------------------------------------------------

    def run_schedule(self, plans: Sequence[Plan]) -> None:
        """Each fault once the job trained its share of the epochs, the last one recovered
        and the plan's gap passed; then the upkeep."""
        last = time.monotonic()
        for plan in plans:
            target = math.floor(plan.index * self.epochs * SPREAD / len(plans))
            with self.tracker.cond:  # behind the epochs: no pause
                ready_at = last if self.tracker.max_epoch >= target else last + plan.gap_s

            def due(target: int = target, ready_at: float = ready_at) -> bool:
                if self.job_over():
                    return True
                return self.tracker.max_epoch >= target and time.monotonic() >= ready_at

            self.tracker.wait(due, END_LIMIT_S)
            if self.job_over():
                raise SoakError(f"the job ended before fault {plan.index} of {len(plans)}")
            fault = self.inject(plan)
            fault.waited_s = round(fault.at_s - (last - self.started), 2)
            self.faults.append(fault)
            self.settle_joins()
            recovery = "—" if fault.recovery_s is None else f"{fault.recovery_s:.2f} s"
            if fault.kind == "join" and fault.recovery_s is None:
                recovery = "(pending: a cold start)"
            extra = ", ".join(
                f"{k} {v:.2f}" for k, v in fault.detail.items() if isinstance(v, float)
            )
            say(
                f"{plan.index}/{len(plans)} {plan.kind} {fault.target} at {fault.ranks_before} "
                f"ranks: stepping again after {recovery}{'; ' + extra if extra else ''}"
                f"{'; PROBLEM: ' + fault.problem if fault.problem else ''}"
            )
            if fault.problem:
                self.problems.append(f"fault {plan.index} ({plan.kind}): {fault.problem}")
            if fault.recovery_s is None and fault.kind != "join" and not self.job_over():
                say(f"fault {plan.index}: no recovery within its limit; waiting for the ring")
            self.tend()
            last = time.monotonic()

    def inject(self, plan: Plan) -> Fault:
        """Wait until the job may take ``plan``'s fault, then make it and time the recovery."""
        if plan.kind == "join" and len(self.pool()) >= MAX_NODES:
            self._trim()
        if plan.kind in ("takeover", "adopt"):
            self.ensure_standby()
        if plan.kind in ETCD_KINDS and poll_until(self.etcd.whole, ETCD_LIMIT_S) is None:
            raise SoakError("the etcd cluster is not whole again")
        need = 2  # ranks: the survivors of a kill, a leave or a cut hold the committed state
        if not self.tracker.wait(
            lambda: self.job_over() or self.tracker.healthy(need), HEALTH_LIMIT_S
        ):
            raise SoakError(f"not {need} ranks stepping within {HEALTH_LIMIT_S:.0f} s")
        if self.job_over():
            raise SoakError(f"the job ended before fault {plan.index}")
        with self.tracker.cond:
            epoch = self.tracker.latest_ring()
            ranks = self.tracker.rings[epoch]
        fault: Fault = getattr(self, f"_{plan.kind}")(plan, epoch, ranks)
        return fault

    def _trim(self) -> None:
        """Upkeep before a join into a full pool: the newest node leaves (SIGTERM)."""
        nodes = self.ring_nodes() or self.pool()  # not a node that is still joining
        node = max(nodes, key=lambda n: n.proc.pid)
        node.proc.send_signal(signal.SIGTERM)
        node.state = "leaving"
        self.upkeep["leaves"] += 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=LEAVE_LIMIT_S)

    def _recovery(
        self,
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
            at = self.tracker.recovered(moment, min_epoch, **which)
            if at is not None:
                found.append(at)
            return at is not None or self.job_over()

        self.tracker.wait(done, limit)
        end = found[0] if found else time.monotonic()
        with self.tracker.cond:
            fault.detail["reforms"] = sum(
                moment <= at <= end for at in self.tracker.ring_at.values()
            )
        fault.recovery_s = found[0] - moment if found else None
        if not found and self.job_over():
            fault.detail["ended_first"] = True

    def _hold(self, seconds: float) -> None:
        """A fault's deliberate length: ``seconds``, or until the job ends."""
        self.tracker.wait(self.job_over, seconds)

    def _victim(self, plan: Plan) -> tuple[Node, int]:
        """A training process of the newest ring, and its pid."""
        found: list[tuple[Node, int]] = []

        def look() -> bool:
            nodes = self.ring_nodes()
            if nodes:
                first = nodes.index(chosen(nodes, plan.pick))
                for node in nodes[first:] + nodes[:first]:
                    pid = self.training_pid(node)
                    if pid is not None:
                        found.append((node, pid))
                        return True
            return False

        # A process of the ring may be restarting (its previous fault cost a restart after
        # all): the fault waits for one, as it waits for a healthy ring.
        if poll_until(look, VICTIM_LIMIT_S) is None:
            raise SoakError(f"no training process of the newest ring within {VICTIM_LIMIT_S} s")
        return found[0]

    def _fault(self, plan: Plan, moment: float, target: str, ranks: int) -> Fault:
        return Fault(plan.index, plan.kind, round(self._since(moment), 2), target, ranks)

    # -- the kinds ----------------------------------------------------------------------------

    def _kill(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        node, pid = self._victim(plan)
        moment = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        fault = self._fault(plan, moment, node.slot, ranks)
        self._recovery(fault, moment, epoch + 1)
        return fault

    def _stop(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        node, pid = self._victim(plan)
        moment = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        fault = self._fault(plan, moment, node.slot, ranks)
        if plan.flag:  # a stall, shorter than the agent's limit: the ring stays as it is
            self._hold(plan.hold_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            fault.detail = {"mode": "stall", "stopped_s": round(time.monotonic() - moment, 3)}
            self._recovery(fault, moment, epoch)
            return fault
        killed = poll_until(lambda: not testhosts.process_running(pid), HANG_KILL_LIMIT_S)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        fault.detail = {"mode": "hang"}
        if killed is None:
            fault.problem = f"its agent did not kill the stopped process in {HANG_KILL_LIMIT_S} s"
        else:
            fault.detail["killed_s"] = killed
        self._recovery(fault, moment, epoch + 1)
        return fault

    def _leave(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        node = chosen(self.ring_nodes(), plan.pick)
        moment = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        node.state = "leaving"
        fault = self._fault(plan, moment, node.node_id, ranks)
        self._recovery(fault, moment, epoch + 1, without=node.slot)

        def exits() -> None:  # in the background: the schedule goes on meanwhile
            try:
                code = node.proc.wait(timeout=LEAVE_LIMIT_S)
            except subprocess.TimeoutExpired:
                problem = f"fault {fault.index} (leave): the node did not exit in {LEAVE_LIMIT_S} s"
                self.problems.append(problem)
                return
            fault.detail["exited_s"] = time.monotonic() - moment
            if code != 0:
                self.problems.append(f"fault {fault.index} (leave): the node exited with {code}")

        threading.Thread(target=exits, name=f"leave-{node.node_id}", daemon=True).start()
        return fault

    def _join(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        hosts = self.free_hosts()
        if not hosts:
            raise SoakError("no free host for a join")
        moment = time.monotonic()
        node = self.start_node(chosen(hosts, plan.pick))
        fault = self._fault(plan, moment, f"{node.node_id} on {node.host.name}", ranks)
        # The join checks the job and registers the node (a second); then its process imports
        # TensorFlow cold (tens of seconds on a busy machine): the schedule goes on meanwhile
        # (the ring still steps), and its recovery is read from the record once it steps.
        self.registered(node)
        self.joining.append((fault, moment, epoch + 1, node))
        return fault

    def settle_joins(self, final: bool = False) -> None:
        """The recovery of every join whose node has stepped in a ring by now (all of them,
        or a verdict, when ``final``)."""
        for pending in list(self.joining):
            fault, moment, epoch, node = pending
            with self.tracker.cond:
                at = self.tracker.recovered(moment, epoch, need=node.slot)
                if at is not None:
                    ring_at = self.tracker.ring_at.values()
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
                if self.job_over() and ended == 0:
                    fault.problem = None
                    fault.detail["ended_first"] = True  # the job ended before the node stepped
                if fault.problem:
                    self.problems.append(f"fault {fault.index} (join): {fault.problem}")
            else:
                continue
            self.joining.remove(pending)

    def _takeover(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        leader, standby = self.leader(), self.ensure_standby()
        moment = time.monotonic()
        leader.proc.kill()
        fault = self._fault(plan, moment, f"{leader.name} (standby {standby.name})", ranks)
        self.tracker.wait(
            lambda: (
                self.tracker.saw(standby.name, "took over ring epoch", moment) is not None
                or standby.proc.poll() is not None
            ),
            LAUNCHER_LIMIT_S,
        )
        with self.tracker.cond:
            took = self.tracker.saw(standby.name, "took over ring epoch", moment)
        self.standby = None
        if took is None:
            fault.problem = "the standby did not take the job over"
        else:
            fault.detail["leader_s"] = took - moment
        self._recovery(fault, moment, epoch)
        return fault

    def _adopt(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        leader, standby = self.leader(), self.ensure_standby()
        standby.proc.terminate()  # no standby for this one
        try:
            standby.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            standby.proc.kill()
        self.standby, self.leaderless = None, True
        moment = time.monotonic()
        leader.proc.kill()
        self._hold(plan.hold_s)
        adopter = self._launch(standby=False)
        self.leaderless = False
        fault = self._fault(plan, moment, f"{leader.name}, again as {adopter.name}", ranks)
        fault.detail["leaderless_s"] = time.monotonic() - moment
        self.tracker.wait(
            lambda: (
                self.tracker.saw(adopter.name, "took over ring epoch") is not None
                or adopter.proc.poll() is not None
            ),
            LAUNCHER_LIMIT_S,
        )
        with self.tracker.cond:
            took = self.tracker.saw(adopter.name, "took over ring epoch")
        if took is None:
            fault.problem = "the launcher started again did not adopt the job"
        else:
            fault.detail["leader_s"] = took - moment
        self._recovery(fault, moment, epoch)
        return fault

    def _etcd_restart(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        moment = time.monotonic()
        self.etcd.restart_all()
        fault = self._fault(plan, moment, "all 3 members", ranks)
        fault.detail["etcd_s"] = time.monotonic() - moment
        self._recovery(fault, moment, epoch)
        return fault

    def _member_kill(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        index = chosen(range(self.etcd.size), plan.pick)
        leader = self.etcd.leader() == index
        if plan.flag and not leader:
            with contextlib.suppress(EtcdServerError):  # then a follower it is
                self.etcd.transfer_leadership(index, timeout=5.0)
                leader = True
        moment = time.monotonic()
        self.etcd.kill(index)
        what = f"m{index}{' (leader)' if leader else ''}"
        fault = self._fault(plan, moment, what, ranks)
        self._hold(plan.hold_s)
        self.etcd.restart(index)
        fault.detail["etcd_s"] = time.monotonic() - moment
        self._recovery(fault, moment, epoch)
        return fault

    def _quorum_loss(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        standby = self.standby
        if not self.standby_in_outages and standby is not None and standby.proc.poll() is None:
            # --no-standby-in-outages: no standby that could take the job over as etcd comes
            # back with every lease expired (the case RingPolicy.adopt's outage hold is for).
            standby.proc.terminate()
            try:
                standby.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                standby.proc.kill()
            self.standby = None
        leader = self.etcd.leader()
        other = chosen([i for i in range(self.etcd.size) if i != leader], plan.pick)
        moment = time.monotonic()
        self.etcd.stop(leader)
        self.etcd.stop(other)
        try:
            self._hold(plan.hold_s)
        finally:
            self.etcd.cont(leader)
            self.etcd.cont(other)
        fault = self._fault(plan, moment, f"m{leader} (leader) and m{other}", ranks)
        whole = poll_until(self.etcd.whole, ETCD_LIMIT_S)
        if whole is None:
            fault.problem = f"etcd not whole {ETCD_LIMIT_S:.0f} s after the outage"
        else:
            fault.detail["etcd_s"] = time.monotonic() - moment
        fault.detail["outage_s"] = plan.hold_s
        self._recovery(fault, moment, epoch)
        return fault

    def _partition(self, plan: Plan, epoch: int, ranks: int) -> Fault:
        node = chosen(self.ring_nodes(), plan.pick)
        host = node.host
        moment = time.monotonic()
        host.link_down()
        node.state = "cut"
        fault = self._fault(plan, moment, f"{host.name} ({node.slot})", ranks)
        try:
            self._recovery(fault, moment, epoch + 1, without=node.slot)
            fenced = poll_until(lambda: self.training_pid(node) is None, FENCE_LIMIT_S + 4.0)
            if fenced is None:
                fault.problem = (
                    f"{host.name}'s rank still ran {FENCE_LIMIT_S + 4.0:.0f} s after the cut"
                )
            else:
                fault.detail["fenced_s"] = time.monotonic() - moment
            self._hold(max(0.0, moment + plan.hold_s - time.monotonic()))
        finally:
            host.link_up()
            node.state = "active"
        fault.detail["cut_s"] = time.monotonic() - moment
        return fault

    # -- figures ------------------------------------------------------------------------------

    def result(self, code: int | None, error: str | None, samples: int) -> dict[str, Any]:
        """The run's figures: exit, accuracy, audit, goodput, restarts, faults."""
        self.tracker.close()
        reports = audit.check(self.audit_dir, samples) if any(self.audit_dir.iterdir()) else []
        launcher_lines = self.tracker.texts("launcher")
        accuracies = [m.group(1) for t in self.tracker.texts("node") if (m := _ACCURACY.search(t))]
        with self.tracker.cond:
            steps = list(self.tracker.steps)
            rings = len(self.tracker.rings)
        ended = self.ended or time.monotonic()
        return {
            "job_id": self.job_id,
            "exit_code": code,
            "error": error,
            "succeeded": code == 0 and any(" succeeded: " in t for t in launcher_lines),
            "wall_s": round(ended - self.started, 1),
            "accuracy": float(accuracies[-1]) if accuracies else None,
            "audit": {
                "epochs": len(reports),
                "complete": sorted(r.epoch for r in reports) == list(range(self.epochs)),
                "missing": sum(len(r.missing) for r in reports),
                "duplicated": sum(len(r.duplicated) for r in reports),
                "ok": bool(reports) and all(r.ok for r in reports),
            },
            **goodput(steps),
            "ring_epochs": rings,
            "restarts": sum("; restarting it (" in t for t in launcher_lines),
            "crashes": crash_causes(launcher_lines),
            "state_lost": sum("state lost" in t for t in launcher_lines),
            # Launcher faults hand the job over; a standby also takes over unasked when etcd
            # let the leader's lease expire (an outage longer than the TTL).
            "takeovers": sum("taking over job" in t for t in launcher_lines),
            "planned_takeovers": sum(f.kind in ("takeover", "adopt") for f in self.faults),
            "upkeep": self.upkeep,
            "problems": self.problems,
            "faults": [dataclasses.asdict(f) for f in self.faults],
        }


def run_job(
    name: str,
    plans: Sequence[Plan],
    *,
    hosts: TestHosts,
    etcd: HostEtcd,
    workdir: Path,
    epochs: int,
    log: IO[str],
    samples: int,
    standby_in_outages: bool,
    nodes: int = POOL,
) -> dict[str, Any]:
    """One job from start to end (its processes gone after, whatever happened); its figures."""
    log.write(f"=== {name} run\n")
    say(f"{name} run: {epochs} epochs, {len(plans)} faults")
    job = SoakJob(
        name,
        hosts=hosts,
        etcd=etcd,
        workdir=workdir,
        epochs=epochs,
        log=log,
        standby_in_outages=standby_in_outages,
    )
    error, code = None, None
    try:
        job.start(nodes)
        job.run_schedule(plans)
        code = job.finish(END_LIMIT_S)
        job.settle_joins(final=True)
    except SoakError as exc:
        error = str(exc)
        say(f"{name} run FAILED: {error}")
    except Exception as exc:  # a bug here, or a fault that could not be made: still report
        error = f"{type(exc).__name__}: {exc}"
        log.write(traceback.format_exc())
        say(f"{name} run FAILED: {error}")
    finally:
        job.stop()
    figures = job.result(code, error, samples)
    say(
        f"{name} run: exit {code}, accuracy {figures['accuracy']}, {figures['wall_s']:.0f} s, "
        f"goodput {figures.get('goodput')}, audit {figures['audit']}"
    )
    return figures


# -- the whole soak ----------------------------------------------------------------------------


def by_kind(faults: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: count, recovered, recovery summary, and each numeric detail's summary."""
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        details: dict[str, list[float]] = {}
        for fault in mine:
            for key, value in fault["detail"].items():
                if isinstance(value, float):
                    details.setdefault(key, []).append(value)
        kinds[kind] = {
            "count": len(mine),
            "recovered": sum(f["recovery_s"] is not None for f in mine),
            "recovery_s": summarize([f["recovery_s"] for f in mine]),
            "detail": {key: summarize(values) for key, values in details.items()},
            "modes": sorted({str(f["detail"]["mode"]) for f in mine if "mode" in f["detail"]}),
            # Ring epochs formed while the job recovered: for a fault that changes no ring
            # (a stall, launcher, etcd), a re-form going on already (a restarted rank joining).
            "with_reform": sum(bool(f["detail"].get("reforms")) for f in mine),
        }
    return kinds


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpu": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "commit": commit or "?",
    }


def verdict(result: dict[str, Any]) -> list[str]:
    """What missed: empty when the soak passed."""
    soak, clean = result["soak"], result["clean"]
    missed = list(soak["problems"])
    if soak["error"]:
        missed.append(f"soak run: {soak['error']}")
    if result["faults_injected"] < result["faults_planned"]:
        missed.append(f"{result['faults_injected']} of {result['faults_planned']} faults made")
    unrecovered = [
        f["index"]
        for f in soak["faults"]
        if f["recovery_s"] is None and not f["detail"].get("ended_first")
    ]
    if unrecovered:
        missed.append(f"faults without recovery: {unrecovered}")
    if not soak["succeeded"]:
        missed.append(f"the soak job did not succeed (exit {soak['exit_code']})")
    if not (soak["audit"]["ok"] and soak["audit"]["complete"]):
        missed.append(f"sample audit of the soak run: {soak['audit']}")
    if soak["state_lost"]:
        missed.append(f"state lost {soak['state_lost']} times")
    if clean is not None:
        if not clean["succeeded"] or clean["error"]:
            missed.append(f"the clean run failed: {clean['error'] or clean['exit_code']}")
        delta = result["accuracy_delta_points"]
        if delta is None or abs(delta) > 1.0:
            missed.append(f"accuracy differs from the clean run by {delta} points (> 1)")
    return missed


def notes(standby_in_outages: bool) -> list[str]:
    """What a reader of the figures must know about how they were made."""
    found = [
        "The sample audit cannot see a lost state: a ring that restarts from the initial state "
        "runs every epoch again under a higher ring epoch, and the audit keeps those runs; "
        "`state lost` counts the launcher's own verdicts.",
    ]
    if not standby_in_outages:
        found.insert(
            0,
            "Quorum losses are made without a standby launcher (`--no-standby-in-outages`: it "
            "is stopped before and started again after), so no takeover happens as etcd "
            "returns.",
        )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, help="the schedule's seed (default: a new one)")
    parser.add_argument("--faults", type=int, default=100, help="faults in the schedule (100)")
    parser.add_argument(
        "--epochs", type=int, help=f"the job's epochs (default: {EPOCHS_PER_FAULT} per fault)"
    )
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    parser.add_argument(
        "--no-standby-in-outages",
        action="store_true",
        help="stop the standby launcher before each quorum loss and start it again after (by "
        "default it stays, and may take the job over as etcd returns with every lease expired)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json")
    parser.add_argument("--markdown", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--log", type=Path, default=RESULTS_DIR / "soak.log")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    epochs = args.epochs or max(MIN_EPOCHS, math.ceil(args.faults * EPOCHS_PER_FAULT))
    plans = schedule(seed, args.faults)
    reason = testhosts.available()
    if reason is not None:
        print(f"soak: test hosts cannot be made here: {reason}", file=sys.stderr)
        return 2
    replay = f"make soak SEED={seed}" + (f" FAULTS={args.faults}" if args.faults != 100 else "")
    say(f"seed {seed} ({replay}): {args.faults} faults, {epochs} epochs")

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]  # noqa: PLC0415

    samples = int(0.8 * len(load_digits().images))  # cnn_digits.py's training split
    started, began = datetime.now(UTC), time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="elastic-allreduce-soak-"))
    # What the killed processes leave in their temp folder (autograph files) goes with workdir.
    (workdir / "tmp").mkdir()
    os.environ["TMPDIR"] = str(workdir / "tmp")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    hosts = TestHosts(1 + WORKER_HOSTS)
    runs: dict[str, dict[str, Any] | None] = {"clean": None, "soak": None}
    try:
        with open(args.log, "w", buffering=1) as log:
            hosts.start()
            with inside(hosts[0]):
                etcd = HostEtcd(hosts[0].address(), workdir / "etcd")
                try:
                    etcd.start()
                    say(f"etcd cluster {etcd.endpoints_text} on {hosts[0].name}")
                    for name, schedule_ in (("clean", []), ("soak", plans)):
                        if name == "clean" and args.no_clean:
                            continue
                        runs[name] = run_job(
                            name,
                            schedule_,
                            hosts=hosts,
                            etcd=etcd,
                            workdir=workdir,
                            epochs=epochs,
                            log=log,
                            samples=samples,
                            standby_in_outages=not args.no_standby_in_outages,
                        )
                finally:
                    etcd.close()
    except KeyboardInterrupt as exc:
        say(f"interrupted ({exc or 'Ctrl-C'}): removing everything the soak started")
        return 130
    finally:
        try:
            hosts.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(SNAPSHOT_ROOT, ignore_errors=True)
    soak = runs["soak"]
    assert soak is not None
    clean = runs["clean"]
    delta = None
    if clean is not None and clean["accuracy"] is not None and soak["accuracy"] is not None:
        delta = round(100 * (soak["accuracy"] - clean["accuracy"]), 2)
    result: dict[str, Any] = {
        "schema": 1,
        "seed": seed,
        "replay": replay,
        "started": f"{started:%Y-%m-%d %H:%M} UTC",
        "duration_s": round(time.monotonic() - began, 1),
        "machine": machine(),
        "workload": {
            "script": str(SCRIPT.relative_to(ROOT)),
            "epochs": epochs,
            "global_batch": GLOBAL_BATCH,
            "samples": samples,
            "pool": POOL,
            "max_nodes": MAX_NODES,
            "worker_hosts": WORKER_HOSTS,
            "lease_ttl_s": LEASE_TTL,
        },
        "faults_planned": len(plans),
        "faults_injected": len(soak["faults"]),
        "kinds": by_kind(soak["faults"]),
        "soak": soak,
        "clean": clean,
        "accuracy_delta_points": delta,
    }
    result["notes"] = notes(not args.no_standby_in_outages)
    missed = verdict(result)
    result["missed"] = missed
    result["ok"] = not missed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    soak_report.update(args.markdown, result)
    say(f"wrote {args.out} and the Soak section of {args.markdown}; the log: {args.log}")
    for line in missed:
        say(f"MISSED: {line}")
    say(f"{'passed' if not missed else 'FAILED'} in {result['duration_s'] / 60:.1f} min ({replay})")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
