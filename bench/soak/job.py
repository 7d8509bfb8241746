"""The processes one soak run starts on the test hosts and keeps up: a leading and a standby
launcher on host 0, bare ``elastic-run join`` nodes on the worker hosts; their start, the upkeep
between faults (the pool topped up, a standby again), the job's end and the cleanup. The faults
themselves are made by :mod:`bench.soak.faults`."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, cast

from bench.jobs import ELASTIC_RUN, ROOT, process_tree
from bench.soak.hosts import HostEtcd
from bench.soak.schedule import Fault
from bench.soak.settings import (
    LAUNCHER_LIMIT_S,
    LEASE_TTL,
    LEAVE_LIMIT_S,
    MAX_NODES,
    POOL,
    READY_LIMIT_S,
    SCRIPT,
    SNAPSHOT_ROOT,
    STANDBY_TRIES,
    SoakError,
    say,
)
from bench.soak.tracker import Tracker
from elastic_allreduce import env
from elastic_allreduce._process import merged_output
from tests.helpers.testhosts import Host, TestHosts


@dataclass(eq=False)
class Launcher:
    name: str
    proc: subprocess.Popen[str]

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it still runs 30 s later."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


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
        # In a session of its own: Ctrl-C reaches the soak only, which stops everything.
        proc: subprocess.Popen[str] = host.popen(
            argv, cwd=ROOT, env=self.env, **merged_output(text=True)
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

    def launch(self, standby: bool) -> Launcher:
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

    def since(self, moment: float) -> float:
        return moment - self.started

    # -- start, upkeep, end -------------------------------------------------------------------

    def start(self, nodes: int = POOL) -> None:
        """The leader, a standby and ``nodes`` nodes; returns once every rank steps."""
        name = self.launch(standby=False).name
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
                self.standby = self.launch(standby=True)
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
            self.standby = self.launch(standby=True)
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

    def trim(self) -> None:
        """Upkeep before a join into a full pool: the newest node leaves (SIGTERM)."""
        nodes = self.ring_nodes() or self.pool()  # not a node that is still joining
        node = max(nodes, key=lambda n: n.proc.pid)
        node.proc.send_signal(signal.SIGTERM)
        node.state = "leaving"
        self.upkeep["leaves"] += 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=LEAVE_LIMIT_S)
