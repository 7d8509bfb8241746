"""The agent: one per worker node. Registers the node and runs its training processes.

It keeps ``members/<node>`` alive under its lease, starts ``nproc_per_node`` processes through
:mod:`elastic_allreduce.bootstrap` with the Horovod environment, prefixes their output with job,
ring epoch, rank and slot, reports every exit at ``exits/<slot>/<incarnation>`` (then revokes
the dead process's lease so the launcher learns of it at once), follows the launcher's
directives (``directives/<node>``: restart a slot, replace a stuck one, stop one), turns SIGTERM
into a graceful leave, and stops its processes when the job ends.

It also looks at its processes' state in ``/proc/<pid>/stat`` every STATE_CHECK_INTERVAL: a
process that stays stopped (``T``: SIGSTOP, SIGTSTP; ``t``: held by a tracer) for STOPPED_LIMIT
is killed and reported like any exit, with a note in its output tail, so the launcher handles it
as a hung process (restarted within ``--max-restarts``) about half a second after the stop
instead of when its lease expires. The lease stays the signal for what an agent cannot see: a
node that is dead, stopped as a whole or cut off.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO, Final

from elastic_allreduce import env, logprefix
from elastic_allreduce._process import die_with_parent
from elastic_allreduce.errors import ConfigError, ElasticAllreduceError
from elastic_allreduce.records import keys
from elastic_allreduce.records.keys import slot_id
from elastic_allreduce.records.snapshot import JobSnapshot, SkipReporter, parse_job
from elastic_allreduce.records.values import (
    Directive,
    ExitRecord,
    MemberRecord,
    ProcRecord,
    Ring,
)
from elastic_allreduce.rendezvous.protocol import split_host_port
from elastic_allreduce.store import EtcdStore, Lease
from elastic_allreduce.store.cache import PrefixCache, drain
from launcher.exit_codes import exit_code

log = logging.getLogger(__name__)

_TAIL_LINES: Final = 20
_LEAVE: Final = "leave"

#: Seconds a training process may stay stopped before its agent kills it as hung.
STOPPED_LIMIT: Final = 0.5
#: Seconds between two looks at the training processes' state.
STATE_CHECK_INTERVAL: Final = 0.1
#: Process states (``/proc/<pid>/stat``, field 3) of a stopped process: by a signal; by a tracer.
_STOPPED_STATES: Final = frozenset({"T", "t"})


@dataclass(frozen=True)
class NodeTemplate:
    """What every worker node of a job is started with (the launcher's provisioner, or
    ``elastic-run join``, adds the node's id: :meth:`for_node`)."""

    etcd: str
    job_id: str
    nproc_per_node: int
    command: tuple[str, ...]
    checkpoint_dir: str | None = None
    #: The address peers reach the node at.
    host: str = "127.0.0.1"
    gloo_iface: str = "lo"
    lease_ttl: int = 3
    process_ttl: int = 3
    leave_timeout: float = 60.0
    start_timeout: float = 60.0

    def for_node(self, node_id: str) -> AgentSettings:
        """The settings of one node of this template."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(NodeTemplate)}
        return AgentSettings(**fields, node_id=keys.validate_node_id(node_id))


@dataclass(frozen=True, kw_only=True)
class AgentSettings(NodeTemplate):
    """What one agent needs: its job's node template and its own node id."""

    node_id: str


@dataclass
class _Process:
    index: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    tail: collections.deque[str]
    reader: threading.Thread
    #: When the agent first saw the process stopped (time.monotonic()); None: not stopped.
    stopped_since: float | None = None
    #: Why the agent killed the process, if it did (added to the tail of its exit report).
    killed_because: str | None = None


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``T``, ...); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = raw.rpartition(b")")[2].split()
    return fields[0].decode(errors="replace") if fields else None


class Agent:
    """Runs one node's training processes for one job (see the module docstring)."""

    def __init__(self, settings: AgentSettings) -> None:
        if settings.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {settings.nproc_per_node}")
        keys.validate_node_id(settings.node_id)
        self.settings = settings
        self.store = EtcdStore(settings.etcd, settings.job_id)
        #: Process exits, SIGTERM and the store's changes, in arrival order (see PrefixCache).
        self._events: queue.Queue[object] = queue.Queue()
        self._procs: dict[int, _Process] = {}
        self._desired: dict[int, int] = dict.fromkeys(range(settings.nproc_per_node), 1)
        self._leaving = False
        self._leave_deadline: float | None = None
        self._ring: Ring | None = None
        self._print_lock = threading.Lock()
        self._started: dict[int, int] = {}
        self._lease: Lease | None = None
        self._skips = SkipReporter()
        self._next_state_check = 0.0

    # -- entry point -------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until the job ends or this node has left; return the agent's exit code."""
        settings = self.settings
        if self.store.get(keys.JOB_CONFIG) is None:
            raise ConfigError(
                f"unknown job {settings.job_id!r} at {self.store.describe()}: start it with "
                "`elastic-run ...` first, or check --job-id and --etcd"
            )
        # Before registering: a SIGTERM right after registration must be a graceful leave.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        lease = self._lease = self.store.grant_lease(settings.lease_ttl)
        member = MemberRecord(settings.host, settings.nproc_per_node, os.getpid())
        key = keys.member(settings.node_id)
        if self.store.create(key, member.to_json(), lease=lease) is None:
            lease.revoke()
            raise ConfigError(
                f"node id {settings.node_id!r} is already a member of job {settings.job_id!r}"
            )
        cache = PrefixCache(self.store, self._events)
        try:
            rendezvous = self._wait_for_launcher(cache)
            if rendezvous is None:
                log.info(
                    "[%s node %s] left before the launcher appeared",
                    settings.job_id,
                    settings.node_id,
                )
                return 0
            for index, incarnation in self._desired.items():
                self._start(index, incarnation, rendezvous)
            return self._serve(cache, rendezvous)
        finally:
            cache.close()
            self._stop_all(grace=5.0)
            self.store.close()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(_LEAVE)

    def _wait_for_launcher(self, cache: PrefixCache) -> str | None:
        """The rendezvous address, or None if the node was asked to leave first (SIGTERM)."""
        deadline = time.monotonic() + self.settings.start_timeout
        while not self._leaving:
            leader = self._job(cache).leader
            if leader is not None and leader.record.rendezvous is not None:
                return leader.record.rendezvous
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfigError(
                    f"no launcher for job {self.settings.job_id!r} appeared within "
                    f"{self.settings.start_timeout:.0f} s"
                )
            self._handle(cache, drain(self._events, timeout=min(remaining, 1.0)))
        return None

    # -- the loop ----------------------------------------------------------------------------

    def _serve(self, cache: PrefixCache, rendezvous: str) -> int:
        node = self.settings.node_id
        changed = True
        while True:
            if changed:
                job = self._job(cache)
                if job.ring is not None:
                    self._ring = job.ring.record
                if job.status is not None and job.status.record.phase.final:
                    return 0
                directive = job.directives.get(node)
                if directive is not None:
                    self._apply(directive.record, rendezvous)
            if self._leaving:
                if not self._procs:
                    log.info("[%s node %s] left the job", self.settings.job_id, node)
                    return 0
                if self._leave_deadline is not None and time.monotonic() > self._leave_deadline:
                    self._stop_all(grace=0.0)
            elif not self._procs and not any(
                incarnation > 0 for incarnation in self._desired.values()
            ):
                return 0
            changed = self._handle(cache, drain(self._events, timeout=self._wait_time()))
            self._kill_stopped()

    def _wait_time(self) -> float:
        """How long the loop may wait for events: until the next look at the processes."""
        if not self._procs:
            return 1.0
        return max(0.0, min(1.0, self._next_state_check - time.monotonic()))

    def _kill_stopped(self) -> None:
        """Kill the processes that have stayed stopped for STOPPED_LIMIT (when a look is due)."""
        now = time.monotonic()
        if now < self._next_state_check:
            return
        self._next_state_check = now + STATE_CHECK_INTERVAL
        for proc in list(self._procs.values()):
            if proc.killed_because is not None or proc.popen.returncode is not None:
                continue
            if process_state(proc.popen.pid) not in _STOPPED_STATES:
                proc.stopped_since = None
                continue
            if proc.stopped_since is None:
                proc.stopped_since = now
            stopped_for = now - proc.stopped_since
            if stopped_for < STOPPED_LIMIT:
                continue
            slot = slot_id(self.settings.node_id, proc.index)
            proc.killed_because = (
                f"slot {slot} was stopped (SIGSTOP?) for {stopped_for:.1f} s; killing it so "
                "the ring can move on"
            )
            log.warning("[%s] %s", self._prefix(slot), proc.killed_because)
            proc.popen.kill()

    def _job(self, cache: PrefixCache) -> JobSnapshot:
        """The job as the cache has it now; junk keys are logged once and skipped."""
        job = parse_job(cache.items().values(), cache.revision)
        for skipped in self._skips.new(job):
            log.warning(
                "[%s node %s] ignoring key %r: %s",
                self.settings.job_id,
                self.settings.node_id,
                skipped.key,
                skipped.reason,
            )
        return job

    def _handle(self, cache: PrefixCache, items: list[object]) -> bool:
        """Apply store changes, process exits and SIGTERM; return whether anything happened."""
        for item in items:
            if isinstance(item, _Process):
                self._on_exit(item)
            elif item == _LEAVE:
                self._leave()
            else:
                cache.apply(item)
        return bool(items)

    def _leave(self) -> None:
        if self._leaving:
            return
        self._leaving = True
        self._leave_deadline = time.monotonic() + self.settings.leave_timeout
        member = MemberRecord(
            self.settings.host, self.settings.nproc_per_node, os.getpid(), leaving=True
        )
        self.store.put(keys.member(self.settings.node_id), member.to_json(), lease=self._lease)
        log.info(
            "[%s node %s] SIGTERM: leaving the job gracefully",
            self.settings.job_id,
            self.settings.node_id,
        )

    def _apply(self, directive: Directive, rendezvous: str) -> None:
        self._desired = {i: directive.get(i) for i in range(self.settings.nproc_per_node)}
        for index, incarnation in self._desired.items():
            proc = self._procs.get(index)
            if proc is not None and (incarnation == 0 or proc.incarnation < incarnation):
                if proc.popen.poll() is None:
                    log.info(
                        "[%s] stopping incarnation %d",
                        self._prefix(slot_id(self.settings.node_id, index)),
                        proc.incarnation,
                    )
                    proc.popen.kill()
                continue
            if proc is None and incarnation > self._started.get(index, 0) and not self._leaving:
                self._start(index, incarnation, rendezvous)

    # -- processes ---------------------------------------------------------------------------

    def _start(self, index: int, incarnation: int, rendezvous: str) -> None:
        self._started[index] = incarnation
        settings = self.settings
        slot = slot_id(settings.node_id, index)
        address, port = split_host_port(rendezvous)
        child_env = dict(os.environ)
        child_env.update(
            {
                env.ETCD_ENDPOINTS: settings.etcd,
                env.JOB_ID: settings.job_id,
                env.SLOT: slot,
                env.INCARNATION: str(incarnation),
                env.PROCESS_TTL: str(settings.process_ttl),
                env.HOROVOD_RENDEZVOUS_ADDR: address,
                env.HOROVOD_RENDEZVOUS_PORT: str(port),
                env.HOROVOD_HOSTNAME: slot,
                "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": settings.gloo_iface,
                "CUDA_VISIBLE_DEVICES": child_env.get("CUDA_VISIBLE_DEVICES", str(index)),
                "PYTHONUNBUFFERED": "1",
            }
        )
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if settings.checkpoint_dir:
            child_env[env.CHECKPOINT_DIR] = settings.checkpoint_dir
        command = [
            sys.executable,
            "-m",
            "elastic_allreduce.bootstrap",
            *python_script_args(settings.command),
        ]
        popen = subprocess.Popen(
            command,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl
        )
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        proc = _Process(index, incarnation, popen, tail, threading.Thread())
        proc.reader = threading.Thread(
            target=self._pump, args=(proc, slot), name=f"output-{slot}", daemon=True
        )
        self._procs[index] = proc
        proc.reader.start()
        log.info("[%s] started incarnation %d (pid %d)", self._prefix(slot), incarnation, popen.pid)

    def _pump(self, proc: _Process, slot: str) -> None:
        stream: IO[bytes] | None = proc.popen.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            proc.tail.append(line)
            with self._print_lock:
                epoch, rank = self._place(slot)
                text = logprefix.format_line(self.settings.job_id, epoch, rank, slot, line)
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
        proc.popen.wait()
        self._events.put(proc)

    def _place(self, slot: str) -> tuple[int | None, int | None]:
        """The slot's ring epoch and rank, as far as this agent knows (None: not a member)."""
        ring = self._ring
        if ring is not None and slot in ring.slots:
            return ring.epoch, ring.slots.index(slot)
        return None, None

    def _prefix(self, slot: str) -> str:
        return logprefix.prefix(self.settings.job_id, *self._place(slot), slot)

    def _on_exit(self, proc: _Process) -> None:
        slot = slot_id(self.settings.node_id, proc.index)
        tail = tuple(proc.tail)
        if proc.killed_because is not None:
            # The launcher's crash report quotes the tail's last lines: this says why.
            tail = (*tail, f"agent: {proc.killed_because}")
        record = ExitRecord.from_returncode(proc.popen.returncode, tail)
        self.store.put(keys.exit_(slot, proc.incarnation), record.to_json())
        registered = self.store.get(keys.proc(slot))
        if registered is not None and registered.lease is not None and registered.malformed is None:
            try:
                incarnation = ProcRecord.from_json(registered.key, registered.value).incarnation
            except ElasticAllreduceError:
                incarnation = None
            if incarnation == proc.incarnation:
                self.store.revoke_lease(registered.lease)
        if self._procs.get(proc.index) is proc:
            del self._procs[proc.index]
        log.info(
            "[%s] incarnation %d exited (%s)",
            self._prefix(slot),
            proc.incarnation,
            record.describe(),
        )

    def _stop_all(self, grace: float) -> None:
        for proc in list(self._procs.values()):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for proc in list(self._procs.values()):
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)


def python_script_args(command: Sequence[str]) -> list[str]:
    """The script (or ``-m module``) and arguments of ``python SCRIPT ARGS`` or ``SCRIPT.py``."""
    args = list(command)
    if args and os.path.basename(args[0]).startswith("python"):
        args = args[1:]
    if not args:
        raise ConfigError("the training command is missing: give `-- python train.py [ARGS]`")
    if args[0] == "-m" and len(args) >= 2:
        return args
    if args[0].startswith("-") or not args[0].endswith(".py"):
        raise ConfigError(
            f"cannot run {' '.join(command)!r}: elastic-run runs Python training scripts; "
            "give `-- python SCRIPT.py [ARGS]` or `-- python -m MODULE [ARGS]`"
        )
    if not os.path.isfile(args[0]):
        raise ConfigError(f"training script {args[0]!r} does not exist")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m launcher.agent SETTINGS_JSON``: how the local provisioner starts agents."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    raw = json.loads((sys.argv[1:] if argv is None else list(argv))[0])
    raw["command"] = tuple(raw["command"])
    try:
        return Agent(AgentSettings(**raw)).run()
    except ElasticAllreduceError as exc:
        print(f"elastic-run agent: error: {exc}", file=sys.stderr)
        return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
