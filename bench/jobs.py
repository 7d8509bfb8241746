"""Processes the benchmarks start and read: `elastic-run` jobs, `horovodrun` jobs, helpers.

Every job is a process group of its own whose stdout is read line by line by one thread; each
JSON record a training script prints (``{"event": ...}``) is kept with the monotonic time its
line reached us. Waiting is always on a condition with a deadline (never a bare sleep).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from elastic_allreduce import logprefix
from elastic_allreduce._process import merged_output

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "bench" / "scripts"
ELASTIC_RUN = str(Path(sys.executable).parent / "elastic-run")
STARTUP_LIMIT_S = 180.0  # TensorFlow imports of several workers on few cores are slow
#: horovodrun's prefix: ``[i]<stdout>:text``.
_HOROVODRUN_LINE = re.compile(r"^\[(?P<index>\d+)\]<stdout>:(?P<text>.*)$")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def own_temp_folder() -> Iterator[Path]:
    """``TMPDIR`` of every process started meanwhile names a folder of the run's own, removed
    at the end: a benchmark kills many training processes, and each leaves TensorFlow's
    autograph files in its temp folder. This process keeps the machine's (pinned first)."""
    folder = Path(tempfile.mkdtemp(prefix="eab-", dir=tempfile.gettempdir()))
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        shutil.rmtree(folder, ignore_errors=True)


class BenchError(RuntimeError):
    """A benchmark could not be measured (a job did not start, died, or never got there)."""


@dataclass(frozen=True)
class Record:
    """One JSON record a training process printed."""

    arrived: float  # time.monotonic() when the line reached the bench
    source: str  # the slot (elastic-run) or horovodrun's launch index
    data: dict[str, Any]

    @property
    def event(self) -> str | None:
        value = self.data.get("event")
        return value if isinstance(value, str) else None


def start_lines(command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``command`` from the repository root in a session of its own, its stdout and stderr
    merged into one unbuffered text stream of lines."""
    return subprocess.Popen(
        list(command),
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        **merged_output(text=True),
    )


class LineJob:
    """A process group whose stdout lines are parsed into :class:`Record` s by a thread.

    A context manager: leaving it kills the whole process group (and reaps the leader).
    """

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.command = list(command)
        self.records: list[Record] = []
        self.tail: deque[str] = deque(maxlen=40)  # last lines that are not records
        self.eof = False
        self._cond = threading.Condition()
        self.proc = start_lines(self.command, env)
        self._reader = threading.Thread(target=self._read, name="job-stdout", daemon=True)
        self._reader.start()

    def __enter__(self) -> LineJob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def split(self, line: str) -> tuple[str, str] | None:
        """Who printed a worker's line (its slot) and what; None for other lines."""
        parsed = logprefix.parse_line(line)
        return None if parsed is None else (parsed.slot, parsed.text)

    def parse(self, line: str, arrived: float) -> Record | None:
        """The record in one output line, if it holds one."""
        split = self.split(line)
        if split is None:
            return None
        who, text = split
        if not text.startswith("{"):
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        return Record(arrived, who, data)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            arrived = time.monotonic()
            line = raw.rstrip("\n")
            record = self.parse(line, arrived)
            with self._cond:
                if record is None:
                    self.tail.append(line)
                else:
                    self.records.append(record)
                self._cond.notify_all()
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``predicate()`` (called under the lock) holds; BenchError on timeout/EOF."""
        with self._cond:
            if self._cond.wait_for(lambda: predicate() or self.eof, timeout) and predicate():
                return
        raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}: {self.why()}")

    def wait_seconds(self, seconds: float) -> None:
        """Let the job run ``seconds`` longer; BenchError if its output ends meanwhile."""
        with self._cond:
            if self._cond.wait_for(lambda: self.eof, max(0.0, seconds)):
                raise BenchError(f"the job ended early: {self.why()}")

    def snapshot(self, event: str | None = None) -> list[Record]:
        with self._cond:
            return [r for r in self.records if event is None or r.event == event]

    def finish(self, timeout: float) -> int:
        """Wait for the job to exit by itself; its exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"the job did not finish in {timeout:.0f} s: {self.why()}") from exc
        self._reader.join(timeout=10)
        return code

    def why(self) -> str:
        with self._cond:
            state = "output ended" if self.eof else "still running"
            tail = " | ".join(list(self.tail)[-10:])
        return f"{state}; exit code {self.proc.poll()}; last lines: {tail}"

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after a grace period; reap."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join(timeout=10)


class ElasticRunJob(LineJob):
    """``elastic-run --etcd E --job-id J [FLAGS] -- python SCRIPT ARGS``."""

    def __init__(
        self,
        etcd: str,
        job_id: str,
        *,
        flags: Sequence[str],
        script: str,
        script_args: Sequence[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.job_id = job_id
        command = [
            ELASTIC_RUN,
            *("--etcd", etcd, "--job-id", job_id),
            *flags,
            *("--", "python", script, *script_args),
        ]
        super().__init__(command, env)


class HorovodRunJob(LineJob):
    """A ``horovodrun`` command; its workers' lines come prefixed ``[i]<stdout>:``."""

    def split(self, line: str) -> tuple[str, str] | None:
        match = _HOROVODRUN_LINE.match(line)
        return None if match is None else (match["index"], match["text"])


def _stat_fields(pid: int) -> list[str]:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rindex(")") + 2 :].split()  # the fields after "(comm)"


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (gone ones count 0)."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _is_worker(pid: int, marker: str) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def step_rate(
    job: LineJob,
    seconds: float,
    size: int,
    *,
    warmup_steps: int = 20,
    settle_s: float = 3.0,
    extra_pids: tuple[int, ...] = (),
) -> dict[str, float]:
    """Rank 0's steps per second at ``size`` ranks over ``seconds``, the same for every launcher.

    Waits for ``warmup_steps`` step records of rank 0 at ``size``, then ``settle_s`` more, then
    counts rank 0's step records that arrive in the next ``seconds`` seconds; a step at another
    size in the window (a worker was lost) makes it a :class:`BenchError`. Also returns the CPU
    the job used in that window, in cores: its training processes (``workers_cpu``) and the
    rest it runs plus ``extra_pids`` (``others_cpu``: launcher, agents, etcd, horovodrun's
    driver).
    """

    def rank0_steps() -> int:
        return sum(
            1
            for r in job.records
            if r.event == "step" and r.data.get("rank") == 0 and r.data.get("size") == size
        )

    job.wait_for(
        lambda: rank0_steps() >= warmup_steps, STARTUP_LIMIT_S, f"rank 0 to warm up at {size}"
    )
    job.wait_seconds(settle_s)
    pids = process_tree(job.proc.pid) + list(extra_pids)
    workers = [pid for pid in pids if _is_worker(pid, "hvd_steps.py")]
    others = [pid for pid in pids if pid not in workers]
    cpu_before = cpu_seconds(workers), cpu_seconds(others)
    start = time.monotonic()
    end = start + seconds
    job.wait_seconds(seconds)
    cpu_after = cpu_seconds(workers), cpu_seconds(others)
    window = [
        r for r in job.snapshot("step") if r.data.get("rank") == 0 and start < r.arrived <= end
    ]
    sizes = {r.data.get("size") for r in window}
    if sizes != {size}:
        raise BenchError(f"rank 0 stepped at sizes {sorted(sizes)}, not only {size}: {job.why()}")
    return {
        "steps_per_s": len(window) / seconds,
        "workers_cpu": (cpu_after[0] - cpu_before[0]) / seconds,
        "others_cpu": (cpu_after[1] - cpu_before[1]) / seconds,
    }


def summarize(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min, max and count of the values that were measured (None: a failed trial)."""
    done = sorted(v for v in values if v is not None)
    result: dict[str, Any] = {
        "values": [None if v is None else round(v, 6) for v in values],
        "n": len(done),
        "failed": len(values) - len(done),
    }
    if done:
        result.update(median=statistics.median(done), min=done[0], max=done[-1])
    return result


def first_steps(
    job: LineJob,
    after: float,
    size: int,
    *,
    members: set[Any],
    key: Callable[[Record], Any],
    timeout: float,
) -> dict[Any, float]:
    """When each of ``members`` (by ``key``) first printed a step at ``size`` after ``after``.

    Raises :class:`BenchError` when they did not all do so within ``timeout`` seconds.
    """
    first: dict[Any, float] = {}
    mark = 0

    def done() -> bool:
        nonlocal mark
        for record in job.records[mark:]:
            if record.arrived > after and record.event == "step":
                member = key(record)
                if record.data.get("size") == size and member in members:
                    first.setdefault(member, record.arrived)
        mark = len(job.records)
        return set(first) == members

    job.wait_for(done, timeout, f"{sorted(members)} to step at size {size} (got {sorted(first)})")
    return first
