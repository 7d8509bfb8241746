"""Run real `elastic-run` jobs (real etcd, Horovod/Gloo, processes) and read what they print."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from elastic_allreduce import logprefix
from elastic_allreduce.commits import shm as shm_snapshot
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import MemberRecord, ProcRecord
from elastic_allreduce.store import EtcdStore
from tests.conftest import ROOT, fresh_job_id
from tests.helpers import leftovers

ELASTIC_RUN = str(Path(sys.executable).parent / "elastic-run")
HVD_SCRIPT = str(ROOT / "tests" / "scripts" / "hvd_elastic.py")
EA_SCRIPT = str(ROOT / "tests" / "scripts" / "ea_elastic.py")
KERAS_SCRIPT = str(ROOT / "tests" / "scripts" / "ea_keras_fit.py")
DATA_SCRIPT = str(ROOT / "tests" / "scripts" / "ea_data.py")
#: Trains until a stop file appears: the test decides when training ends (see :func:`until`).
HANG_SCRIPT = str(ROOT / "tests" / "scripts" / "hang_at_step.py")
UNTIL_SCRIPT = str(ROOT / "tests" / "scripts" / "train_until.py")
#: The same scenarios run on a plain Horovod elastic script and on elastic_allreduce's API.
SCRIPTS = {"horovod-api": HVD_SCRIPT, "elastic-allreduce-api": EA_SCRIPT}
#: Seconds :meth:`Job.finish` waits for the end of the output once the job has exited.
OUTPUT_END_TIMEOUT = 10.0
#: Seconds :meth:`Job.stop` waits for the killed processes to go.
STOP_TIMEOUT = 10.0


class EtcdEndpoints(Protocol):
    """What a job needs of its etcd: the ``--etcd`` value (one server, or a whole cluster)."""

    @property
    def endpoints_text(self) -> str: ...


@dataclass
class Event:
    """One JSON line printed by a training script, with the agent's prefix."""

    slot: str
    epoch: str
    data: dict[str, Any]
    at: float


@dataclass
class Job:
    """A running `elastic-run` job whose output is collected line by line."""

    proc: subprocess.Popen[str]
    job_id: str
    store: EtcdStore
    lines: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    _new: queue.Queue[str] = field(default_factory=queue.Queue)
    _reader: threading.Thread | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            parsed = logprefix.parse_line(line)
            if parsed is not None and parsed.text.startswith("{"):
                try:
                    data = json.loads(parsed.text)
                except json.JSONDecodeError:
                    data = None
                if isinstance(data, dict):
                    epoch = "-" if parsed.epoch is None else str(parsed.epoch)
                    self.events.append(Event(parsed.slot, epoch, data, time.monotonic()))
            self._new.put(line)
        self._new.put("")

    def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float,
        what: str,
        *,
        after_exit: bool = False,
    ) -> None:
        """Block until ``predicate()`` holds (checked as output arrives) or fail with the log;
        at once when the process has exited, unless ``after_exit`` (its output may go on:
        processes it started that outlive it write to the same pipe)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            exited = not after_exit and self.proc.poll() is not None and self._new.empty()
            if remaining <= 0 or exited:
                if predicate():
                    return
                raise AssertionError(
                    f"timed out waiting for {what}; output:\n" + self.tail(150, quiet=True)
                )
            with contextlib.suppress(queue.Empty):
                self._new.get(timeout=min(remaining, 0.5))

    def commits(self, size: int | None = None) -> list[Event]:
        return [
            e
            for e in self.events
            if e.data.get("event") == "commit" and (size is None or e.data.get("size") == size)
        ]

    def epochs(self, size: int) -> list[Event]:
        """The "epoch" lines of tests/scripts/ea_keras_fit.py at ring size ``size``."""
        return [e for e in self.events if e.data.get("event") == "epoch" and e.data["size"] == size]

    def done(self) -> list[Event]:
        return [e for e in self.events if e.data.get("event") == "done"]

    def pid(self, key: str) -> int:
        """The pid of a ``procs/<slot>`` or ``members/<node>`` record."""
        kv = self.store.get(key)
        assert kv is not None, f"{key} is not in the store"
        if keys.parse(key).kind is keys.KeyKind.PROC:
            return ProcRecord.from_json(key, kv.value).pid
        pid = MemberRecord.from_json(key, kv.value).pid
        assert pid is not None, f"{key} has no pid"
        return pid

    def finish(self, timeout: float = 120) -> int:
        """Wait for the job to exit and for the end of its output (every line read and parsed:
        the reader thread has seen end-of-file); its exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            # Where it waits: elastic-run prints every thread's stack on SIGUSR1.
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(AssertionError):
                self.wait_for(
                    lambda: any(line.startswith("Current thread") for line in self.lines),
                    5,
                    "the stacks",
                )
            raise AssertionError("job did not finish; output:\n" + self.tail(160)) from exc
        if self._reader is not None:
            self._reader.join(timeout=OUTPUT_END_TIMEOUT)
            if self._reader.is_alive():  # a process still holds the pipe open
                raise AssertionError(
                    f"the job exited with {code} but its output did not end within "
                    f"{OUTPUT_END_TIMEOUT} s; output:\n" + self.tail()
                )
        return code

    def tail(self, lines: int = 80, *, quiet: bool = False) -> str:
        """The last ``lines`` lines of the job's output; ``quiet`` leaves out the scripts'
        per-commit JSON lines (what happened to the ring stays)."""
        shown = [line for line in self.lines if not quiet or '"event": "commit"' not in line]
        text = "\n".join(shown[-lines:])
        # Why processes ended, last: a CI log keeps only the end of a failure's report.
        ends = [line for line in self.lines if any(mark in line for mark in _ENDS)]
        if ends:
            text += "\nhow processes of the job ended:\n" + "\n".join(ends[-12:])
        return text

    def stop(self) -> None:
        """End the job's whole process group and every process below it (agents and training
        processes run in sessions of their own), wait until they are gone, close the store."""
        try:
            left = leftovers.end_process_tree(
                self.proc.pid, STOP_TIMEOUT, with_descendants=self.proc.returncode is None
            )
            self.proc.wait(timeout=STOP_TIMEOUT)
            assert not left, "processes of the job outlived SIGKILL: " + "; ".join(map(str, left))
        finally:
            self.store.close()
            # Agents SIGKILLed here cannot remove their slots' snapshots from shared memory.
            shutil.rmtree(Path(shm_snapshot.DEFAULT_ROOT) / self.job_id, ignore_errors=True)


#: The launcher's lines that say why a process of the job ended (Job.tail repeats them).
_ENDS = (" crashed: ", " lost its lease", " was killed because", " left (", " exited (")


def start_job(
    etcd: EtcdEndpoints,
    *flags: str,
    script: str = HVD_SCRIPT,
    script_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Job:
    job_id = fresh_job_id("it")
    command = [
        ELASTIC_RUN,
        "--etcd",
        etcd.endpoints_text,
        "--job-id",
        job_id,
        *flags,
        "--",
        "python",
        script,
        *script_args,
    ]
    return watch_process(command, etcd, job_id, env)


def join_job(etcd: EtcdEndpoints, job: Job, *flags: str, env: dict[str, str] | None = None) -> Job:
    """Run `elastic-run join` for ``job`` in the background (its output read like a job's)."""
    command = [ELASTIC_RUN, "join", "--etcd", etcd.endpoints_text, "--job-id", job.job_id, *flags]
    return watch_process(command, etcd, job.job_id, env)


def watch_process(
    command: list[str], etcd: EtcdEndpoints, job_id: str, env: dict[str, str] | None = None
) -> Job:
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        store = EtcdStore(etcd.endpoints_text, job_id)
    except BaseException:
        leftovers.end_process_tree(proc.pid, timeout=STOP_TIMEOUT)
        proc.wait(timeout=STOP_TIMEOUT)
        raise
    job = Job(proc, job_id, store)
    job._reader = threading.Thread(target=job._read, daemon=True)
    job._reader.start()
    return job


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ELASTIC_RUN, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_cli_module(
    module: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def slot_of_rank(job: Job, rank: int, size: int) -> str:
    for event in reversed(job.commits(size)):
        if event.data["rank"] == rank:
            return event.slot
    raise AssertionError(
        f"no commit from rank {rank} at size {size}; what the ring did:\n"
        + job.tail(150, quiet=True)
    )


def last_step_before_restart(job: Job, size: int, slots: Iterable[str]) -> int:
    """The last step the processes of ``slots`` committed at ``size`` before they were killed:
    a slot's commits up to its next process's "resumed" event. Call it once the job is over:
    a commit printed just before the kill may be read after it."""
    last = 0
    for slot in slots:
        for event in (e for e in job.events if e.slot == slot):
            if event.data.get("event") == "resumed":
                break
            if event.data.get("event") == "commit" and event.data.get("size") == size:
                last = max(last, int(event.data["step"]))
    return last


def until(stop_file: Path, *, commit_every: int = 5, step_delay: float = 0.03) -> tuple[str, ...]:
    """UNTIL_SCRIPT's arguments: train until ``stop_file`` appears, committing every
    ``commit_every`` steps of ``step_delay`` seconds."""
    return (
        *("--stop-file", str(stop_file), "--commit-every", str(commit_every)),
        *("--step-delay", str(step_delay)),
    )
