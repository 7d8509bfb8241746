"""A node's training processes, supervised: started through :mod:`elastic_allreduce.bootstrap`
with the agent -> process contract (:class:`elastic_allreduce.runtime.ProcessContract`), their
output prefixed with job, ring epoch, rank and slot, their exits reported at
``exits/<slot>/<incarnation>`` (then the dead process's ``procs/<slot>`` record deleted: it is
under the node's lease, which the agent keeps alive; a report etcd does not take in time is
sent again on a later turn of the agent's loop), stopped ones killed, all of them stopped when
the node stops.

Every STATE_CHECK_INTERVAL the supervisor looks at its processes' state in
``/proc/<pid>/stat``: a process that stays stopped (``T``: SIGSTOP, SIGTSTP; ``t``: held by a
tracer) for STOPPED_LIMIT is killed and reported like any exit, with a note in its output tail,
so the launcher handles it as a hung process about half a second after the stop.

The agent (:mod:`launcher.node.agent`) decides which incarnation of each slot runs; this module
only does what it is told, and hands each exit back to the agent's loop.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from elastic_allreduce import env, logprefix
from elastic_allreduce._process import die_with_parent, merged_output
from elastic_allreduce.commits import shm
from elastic_allreduce.errors import ConfigError, ElasticAllreduceError, StoreError
from elastic_allreduce.records import keys
from elastic_allreduce.records.keys import slot_id
from elastic_allreduce.records.values import ExitRecord, ProcRecord, ScriptError
from elastic_allreduce.rendezvous.protocol import Endpoint, split_host_port
from elastic_allreduce.runtime import NOT_INHERITED, ProcessContract
from elastic_allreduce.store import EtcdStore
from launcher.node.persister import SnapshotPersister
from launcher.vocabulary import AgentSettings

log = logging.getLogger(__name__)

_TAIL_LINES: Final = 20
#: Seconds a training process may stay stopped before its agent kills it as hung.
STOPPED_LIMIT: Final = 0.5
#: Seconds between two looks at the training processes' state.
STATE_CHECK_INTERVAL: Final = 0.1
#: Seconds a process the launcher replaces while it lives gets to print its stacks (SIGUSR1).
STACKS_WAIT: Final = 1.0
#: Seconds a stopping agent waits for a checkpoint copy under way (launcher.node.persister).
PERSIST_CLOSE_WAIT: Final = 30.0
#: Process states (``/proc/<pid>/stat``, field 3) of a stopped process: by a signal; by a tracer.
_STOPPED_STATES: Final = frozenset({"T", "t"})
#: The most bytes of a process's error file the agent reads (the record allows ~30 KB).
MAX_ERROR_FILE: Final = 64 * 1024


@dataclass
class Process:
    """One training process of the node (one incarnation of one slot)."""

    index: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    tail: collections.deque[str]
    reader: threading.Thread
    #: When the agent first saw the process stopped (time.monotonic()); None: not stopped.
    stopped_since: float | None = None
    #: Why the agent killed the process, if it did (added to the tail of its exit report).
    killed_because: str | None = None
    #: Killed because the node was cut off from etcd (its exit is not reported).
    fenced: bool = False
    #: Where its bootstrap writes the error its script ended with (see read_script_error).
    error_file: str | None = None


class Processes:
    """The training processes of one node (see the module docstring).

    ``exited(process)`` hands an ended process to the agent's loop (from the process's output
    thread), which calls :meth:`on_exit`; ``place(slot)`` is the slot's ring epoch and rank as
    the agent knows them (None, None: not a member), for the output's prefix.
    """

    def __init__(
        self,
        settings: AgentSettings,
        store: EtcdStore,
        exited: Callable[[Process], None],
        place: Callable[[str], tuple[int | None, int | None]],
    ) -> None:
        self.settings = settings
        self._store = store
        self._exited = exited
        self.place = place
        #: The live processes by slot index.
        self.running: dict[int, Process] = {}
        #: The newest incarnation started of each slot index.
        self.started: dict[int, int] = {}
        #: The job's settings that the contract carries (the agent sets them once it read
        #: the job's configuration).
        self.outage_timeout = 0.0
        self.warm_join = False
        #: The node's lease now (the agent sets it at each registration): a process started
        #: next writes its record under it.
        self.node_lease: int | None = None
        #: Each live process's record as last seen in the store, by slot index: the agent
        #: writes them again when it registers the node under a new lease (after etcd let the
        #: old one expire in an outage, which took the records with it).
        self.records: dict[int, ProcRecord] = {}
        #: Ended processes whose exit etcd did not take yet (tried again on the loop's turns).
        self._unreported: list[Process] = []
        self._print_lock = threading.Lock()
        self._next_state_check = 0.0
        self._devices = slot_devices(
            os.environ.get("CUDA_VISIBLE_DEVICES"), settings.nproc_per_node
        )
        #: Where this node's slots keep their snapshot in shared memory (None: off), and the
        #: slots given a folder there, which the agent removes when it exits.
        root = os.environ.get(env.SNAPSHOT_ROOT, shm.DEFAULT_ROOT)
        self._snapshot_root = None if root in ("", shm.OFF) else root
        self._snapshot_slots: set[str] = set()
        #: Copies rank 0's snapshots into the checkpoint folder for it (with --checkpoint-dir
        #: and snapshots); made when a process starts, closed whenever the processes stop.
        self._persister: SnapshotPersister | None = None
        #: A folder of this agent's, for the files in which its processes' bootstraps write
        #: the errors their scripts ended with (made at the first start, removed at the end).
        self._error_dir: str | None = None

    def check_snapshot_root(self) -> None:
        """Before the first start: turn snapshots off when their root is not usable."""
        if self._snapshot_root is not None and not shm.check_root(self._snapshot_root):
            self._snapshot_root = None

    def close(self) -> None:
        """The node stops: its processes (SIGTERM, then SIGKILL after 5 s), its snapshot
        folders (no shared memory is left behind) and its error files."""
        self.stop_all(grace=5.0)
        if self._snapshot_root is not None:
            shm.remove_slots(self._snapshot_root, self.settings.job_id, self._snapshot_slots)
        if self._error_dir is not None:
            shutil.rmtree(self._error_dir, ignore_errors=True)

    # -- starting --------------------------------------------------------------------------

    def start(self, index: int, incarnation: int, rendezvous: Endpoint) -> None:
        """Start incarnation ``incarnation`` of slot ``index``, its launcher at ``rendezvous``."""
        self.started[index] = incarnation
        settings = self.settings
        slot = slot_id(settings.node_id, index)
        address, port = split_host_port(rendezvous.address)
        link = None
        snapshot_dir = None
        if self._snapshot_root is not None:
            folder = shm.prepare_slot(self._snapshot_root, settings.job_id, slot)
            if folder is not None:
                self._snapshot_slots.add(slot)
                snapshot_dir = str(folder)
                link = self._persist_link(slot, folder)
        if self._error_dir is None:
            self._error_dir = tempfile.mkdtemp(prefix=f"ea-errors-{settings.node_id}-")
        error_file = os.path.join(self._error_dir, f"{slot}.{incarnation}.json")
        with contextlib.suppress(FileNotFoundError):
            os.remove(error_file)
        contract = ProcessContract(
            slot=slot,
            incarnation=incarnation,
            etcd=settings.etcd,
            job_id=settings.job_id,
            node_lease=self.node_lease,
            outage_timeout=self.outage_timeout,
            local_size=settings.nproc_per_node,
            gpu_index=int(self._devices[index]) if self._devices[index] else None,
            rendezvous_token=rendezvous.token,
            warm_join=self.warm_join,
            checkpoint_dir=settings.checkpoint_dir or None,
            keep_checkpoints=settings.keep_checkpoints if settings.checkpoint_dir else None,
            tensorboard_dir=settings.tensorboard_dir or None,
            snapshot_dir=snapshot_dir,
            persist_fd=None if link is None else link.fileno(),
            error_file=error_file,
            rendezvous_addr=address,
            rendezvous_port=port,
            gloo_iface=settings.gloo_iface,
        )
        child_env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        child_env.update(contract.environ())
        child_env.update(
            {
                env.HOROVOD_CONTROLLER: "gloo",
                env.HOROVOD_CPU_OPERATIONS: "gloo",
                "PYTHONUNBUFFERED": "1",
            }
        )
        child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        command = [
            sys.executable,
            "-m",
            "elastic_allreduce.bootstrap",
            *python_script_args(settings.command),
        ]
        popen = subprocess.Popen(
            command,
            env=child_env,
            cwd=settings.workdir,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl
            pass_fds=() if link is None else (link.fileno(),),
            **merged_output(text=False),
        )
        if link is not None:
            link.close()  # the process has its copy
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        proc = Process(index, incarnation, popen, tail, threading.Thread(), error_file=error_file)
        proc.reader = threading.Thread(
            target=self._pump, args=(proc, slot), name=f"output-{slot}", daemon=True
        )
        self.running[index] = proc
        proc.reader.start()
        log.info("[%s] started incarnation %d (pid %d)", self.prefix(slot), incarnation, popen.pid)

    def _persist_link(self, slot: str, folder: Path) -> socket.socket | None:
        """The process's end of a new persistence channel, or None without a checkpoint
        folder (:mod:`launcher.node.persister`)."""
        settings = self.settings
        if not settings.checkpoint_dir:
            return None
        if self._persister is None:
            self._persister = SnapshotPersister(
                settings.checkpoint_dir, settings.job_id, settings.keep_checkpoints
            )
        return self._persister.link(slot, folder)

    def _pump(self, proc: Process, slot: str) -> None:
        stream: IO[bytes] | None = proc.popen.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            proc.tail.append(line)
            with self._print_lock:
                epoch, rank = self.place(slot)
                text = logprefix.format_line(self.settings.job_id, epoch, rank, slot, line)
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
        proc.popen.wait()
        self._exited(proc)

    def prefix(self, slot: str) -> str:
        """The output prefix of ``slot``'s lines (job, ring epoch, rank, slot)."""
        return logprefix.prefix(self.settings.job_id, *self.place(slot), slot)

    # -- stopping --------------------------------------------------------------------------

    def replace(self, index: int, *, stacks: bool) -> None:
        """Kill slot ``index``'s live process (a newer incarnation replaces it, or the slot
        stops); ``stacks``: first ask it where it waits (:func:`print_stacks_of`)."""
        proc = self.running.get(index)
        if proc is None or proc.popen.poll() is not None:
            return
        log.info(
            "[%s] stopping incarnation %d",
            self.prefix(slot_id(self.settings.node_id, index)),
            proc.incarnation,
        )
        if stacks:
            print_stacks_of(proc.popen)
        proc.popen.kill()

    def next_check_in(self, now: float) -> float:
        """Seconds until the next look at the processes' state."""
        return self._next_state_check - now

    def kill_stopped(self) -> None:
        """Kill the processes that have stayed stopped for STOPPED_LIMIT (when a look is due)."""
        now = time.monotonic()
        if now < self._next_state_check:
            return
        self._next_state_check = now + STATE_CHECK_INTERVAL
        for proc in list(self.running.values()):
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
            log.warning("[%s] %s", self.prefix(slot), proc.killed_because)
            proc.popen.kill()

    def fence(self) -> None:
        """The node was cut off: kill every process at once; their exits are not reported."""
        for proc in self.running.values():
            proc.fenced = True
        self.stop_all(grace=0.0)
        self.running.clear()

    def stop_all(self, grace: float) -> None:
        """SIGTERM every process (SIGKILL when ``grace`` is 0), SIGKILL those still alive
        after ``grace`` seconds; first let a checkpoint copy under way finish."""
        if self._persister is not None:
            # The copy under way ends first: rank 0 writes its last commit itself on SIGTERM,
            # and a fenced node must not write one of a ring that moved on.
            if not self._persister.close(PERSIST_CLOSE_WAIT):
                log.warning(
                    "[%s node %s] a checkpoint copy still runs after %.0f s; stopping anyway",
                    self.settings.job_id,
                    self.settings.node_id,
                    PERSIST_CLOSE_WAIT,
                )
            self._persister = None
        for proc in list(self.running.values()):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for proc in list(self.running.values()):
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)

    # -- exits -----------------------------------------------------------------------------

    def on_exit(self, proc: Process) -> None:
        """An ended process, in the agent's loop: its exit reported (unless fenced); when etcd
        does not take the report in time, it is kept and sent on a later turn."""
        slot = slot_id(self.settings.node_id, proc.index)
        if proc.fenced:
            log.info("[%s] incarnation %d stopped (fenced)", self.prefix(slot), proc.incarnation)
            return
        try:
            self._report_exit(proc, slot)
        except StoreError as exc:
            # etcd is unreachable: the lease check fences the node if it stays so.
            log.warning(
                "[%s] could not report the exit yet (trying again): %s", self.prefix(slot), exc
            )
            self._unreported.append(proc)
        if self.running.get(proc.index) is proc:
            del self.running[proc.index]
            self.records.pop(proc.index, None)

    def report_unreported(self) -> None:
        """Send the exit reports etcd did not take before, oldest first (each is idempotent);
        stops at the first that fails again."""
        while self._unreported:
            proc = self._unreported[0]
            try:
                self._report_exit(proc, slot_id(self.settings.node_id, proc.index))
            except StoreError:
                return
            self._unreported.pop(0)

    def remember(self, records: Mapping[str, ProcRecord]) -> None:
        """Note the records of this node's live processes as the store has them now."""
        for index, proc in self.running.items():
            record = records.get(slot_id(self.settings.node_id, index))
            if record is not None and record.incarnation == proc.incarnation:
                self.records[index] = record

    def _report_exit(self, proc: Process, slot: str) -> None:
        tail = tuple(proc.tail)
        if proc.killed_because is not None:
            # The launcher's crash report quotes the tail's last lines: this says why.
            tail = (*tail, f"agent: {proc.killed_because}")
        error = None if proc.error_file is None else read_script_error(proc.error_file)
        record = ExitRecord.from_returncode(proc.popen.returncode, tail, error)
        self._store.put(keys.exit_(slot, proc.incarnation), record.to_json())
        registered = self._store.get(keys.proc(slot))
        if registered is not None and registered.malformed is None:
            try:
                incarnation = ProcRecord.from_json(registered.key, registered.value).incarnation
            except ElasticAllreduceError:
                incarnation = None
            if incarnation == proc.incarnation:
                # Its record, not a newer incarnation's (a replacement may have registered).
                self._store.delete(keys.proc(slot), expected_mod_revision=registered.mod_revision)
        log.info(
            "[%s] incarnation %d exited (%s)",
            self.prefix(slot),
            proc.incarnation,
            record.describe(),
        )


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


def print_stacks_of(popen: subprocess.Popen[bytes]) -> None:
    """Ask a live process that is about to be replaced (the launcher found it stuck or hung)
    for every thread's stack, which it prints to its output (the bootstrap registered SIGUSR1):
    where it waited, for the log. Waits STACKS_WAIT at most; a stopped process prints nothing."""
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(signal.SIGUSR1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=STACKS_WAIT)


def read_script_error(path: str) -> ScriptError | None:
    """The error a process's script ended with, as its bootstrap wrote it at ``path``, and the
    file removed; None when there is none, or it is not a valid record (logged: the file is
    the process's to write, so it is read as untrusted input)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_ERROR_FILE + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("could not read a training process's error file %s: %s", path, exc)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    try:
        if len(raw) > MAX_ERROR_FILE:
            raise ValueError(f"longer than {MAX_ERROR_FILE} bytes")
        return ScriptError.from_json(path, json.loads(raw))
    except (ValueError, ElasticAllreduceError) as exc:
        log.warning("ignoring a training process's error file %s: %s", path, exc)
        return None


def slot_devices(inherited: str | None, nproc: int) -> list[str]:
    """Each slot's GPU index (``ELASTIC_ALLREDUCE_GPU_INDEX``): its place among the GPUs the
    node was given, which every slot keeps seeing -- an inherited ``CUDA_VISIBLE_DEVICES`` (as
    Slurm or a container runtime sets it) stays as it is, because NCCL's peer-to-peer and
    shared-memory transports need the peers' devices; :mod:`elastic_allreduce.bootstrap.gpu` limits
    TensorFlow to the slot's. ``""`` for every slot when the node was given no GPU (an empty
    ``CUDA_VISIBLE_DEVICES``). ConfigError when it was given fewer GPUs than it runs processes."""
    if inherited is not None:
        given = [device.strip() for device in inherited.split(",") if device.strip()]
        if not given:
            return [""] * nproc
        if len(given) < nproc:
            raise ConfigError(
                f"this node was given {len(given)} GPUs (CUDA_VISIBLE_DEVICES={inherited}) but "
                f"runs {nproc} training processes, one GPU each: lower --nproc-per-node or give "
                "it more"
            )
    return [str(index) for index in range(nproc)]


def check_command(command: Sequence[str], workdir: str | None) -> None:
    """ConfigError unless the training command can run here: the job's working directory and
    (relative to it) its script exist on this host."""
    if workdir is not None and not os.path.isdir(workdir):
        raise ConfigError(
            f"the job's working directory {workdir} (where `elastic-run run` was started) does "
            "not exist on this host: give every host the same directory (a shared or copied "
            "checkout), or start the job from a directory they all have"
        )
    args = python_script_args(command, check_exists=False)
    if args[0] == "-m":
        return
    script = os.path.join(workdir or os.getcwd(), args[0])
    if not os.path.isfile(script):
        raise ConfigError(
            f"training script {script} (from the job's command) does not exist on this host: "
            "give every host the same path to it (a shared or copied checkout)"
        )


def resolve_command(command: Sequence[str]) -> tuple[str, ...]:
    """``command`` with its script as an absolute path, so that a node started in another
    directory, or on another host with the same layout, runs the same file."""
    args = python_script_args(command)
    if args[0] != "-m":
        args[0] = os.path.abspath(args[0])
    return (*command[: len(command) - len(args)], *args)


def python_script_args(command: Sequence[str], *, check_exists: bool = True) -> list[str]:
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
    if check_exists and not os.path.isfile(args[0]):
        raise ConfigError(f"training script {args[0]!r} does not exist")
    return args
