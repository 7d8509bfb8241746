"""Baseline figures for Horovod's own launcher, ``horovodrun`` (Gloo, this machine only).

1. ``horovodrun_elastic_recovery``: elastic ``horovodrun`` with np workers; SIGKILL one non-zero
   rank and time until every survivor steps again at the smaller size.
2. ``horovodrun_static_throughput``: static ``horovodrun --gloo``; rank-0 steps per second.

Both run ``bench/scripts/hvd_steps.py`` and read ``horovodrun``'s stdout, where worker lines come
prefixed like ``[1]<stdout>:``. Elastic ``horovodrun`` blacklists a host when a worker on it fails,
so with one host a single crash ends the job. Here every worker gets its own host alias
(``localhost``, ``127.0.0.1``, the host name, the machine's own IPv4 addresses, ...): horovodrun
runs a worker locally, without ssh, when the alias resolves to one of this machine's interface
addresses (``horovod.runner.gloo_run._exec_command_fn``), so only the crashed worker's alias is
blacklisted and the survivors carry on.

Usage: python bench/horovodrun_baseline.py [--trials N] [--seconds S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

WORKLOAD = Path(__file__).resolve().parent / "scripts" / "hvd_steps.py"
MANY_STEPS = 1_000_000_000  # never reached within a trial
WARMUP_STEPS = 20  # steps each rank must print before measuring
WARMUP_SECONDS = 5.0  # throughput: also skip this long after rank 0's first step
STARTUP_LIMIT_S = 180.0  # TensorFlow imports of several workers on few cores are slow
RECOVERY_LIMIT_S = 90.0
TAG_VAR = "HVD_BASELINE_TAG"  # marks every process of one job, for the clean-up
_PREFIX = re.compile(r"\[(\d+)\]<stdout>:")
_HOST_NAME = re.compile(r"^[\w.-]+$")  # what horovod's host parsing accepts
_SHELLS = frozenset({"sh", "bash", "dash", "env"})


def _log(message: str) -> None:
    print(f"[horovodrun-baseline] {message}", file=sys.stderr, flush=True)


def _horovodrun() -> str:
    """Path of ``horovodrun`` next to this interpreter, else the one on PATH."""
    beside = Path(sys.executable).with_name("horovodrun")
    if beside.exists():
        return str(beside)
    found = shutil.which("horovodrun")
    if found is None:
        raise FileNotFoundError("horovodrun not found next to the interpreter nor on PATH")
    return found


def _proc_file(pid: int, name: str) -> list[str]:
    """NUL-separated contents of /proc/PID/NAME; empty when the process is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``TAG_VAR=tag`` (all processes of one job)."""
    marker = f"{TAG_VAR}={tag}"
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and marker in _proc_file(int(entry.name), "environ")
    ]


def local_host_aliases() -> list[str]:
    """Distinct names that horovodrun treats as this machine (so it starts workers without ssh).

    Uses horovod's own test: the name resolves to an IPv4 address of a local interface.
    """
    from horovod.runner.util import network  # noqa: PLC0415 (keeps the import optional)

    local = network.get_local_host_addresses()
    candidates = ["localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()]
    candidates += sorted(local)
    with contextlib.suppress(OSError):
        for line in Path("/etc/hosts").read_text().splitlines():
            candidates += line.split("#", 1)[0].split()[1:]
    aliases: list[str] = []
    for name in candidates:
        if name in aliases or not _HOST_NAME.match(name):
            continue
        if network.resolve_host_address(name) in local:
            aliases.append(name)
    return aliases


@dataclass(frozen=True)
class _Step:
    arrived: float  # time.monotonic() when horovodrun's line reached us
    index: int | None  # horovodrun's "[i]" prefix (the rank at launch)
    step: int
    size: int
    rank: int


def _parse_step(line: str, arrived: float) -> _Step | None:
    """The step record in one line of horovodrun's output, if it holds one."""
    start = line.find('{"event"')
    if start < 0:
        return None
    try:
        record = json.loads(line[start:])
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("event") != "step":
        return None
    prefix = _PREFIX.search(line[:start])
    try:
        return _Step(
            arrived=arrived,
            index=int(prefix.group(1)) if prefix else None,
            step=int(record["step"]),
            size=int(record["size"]),
            rank=int(record["rank"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


class _HorovodRunJob:
    """One ``horovodrun`` process; its output is parsed by a reader thread.

    Use as a context manager: leaving it kills the launcher and every process it started.
    """

    def __init__(self, args: Sequence[str], extra_env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex
        env = {**os.environ, **(extra_env or {}), TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1"}
        self.command = [_horovodrun(), *args]
        self.steps: list[_Step] = []
        self.counts: Counter[tuple[int, int]] = Counter()  # (rank, size) -> step lines
        self.tail: deque[str] = deque(maxlen=30)  # last lines that are not step records
        self.eof = False
        self._cond = threading.Condition()
        self._proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="horovodrun-stdout", daemon=True)
        self._reader.start()

    def __enter__(self) -> _HorovodRunJob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            arrived = time.monotonic()
            step = _parse_step(line, arrived)
            with self._cond:
                if step is None:
                    self.tail.append(line.rstrip())
                else:
                    self.steps.append(step)
                    self.counts[step.rank, step.size] += 1
                self._cond.notify_all()
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate`` (called under the lock) holds; False on timeout or EOF."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate() or self.eof, timeout) and predicate()

    def alive_after(self, seconds: float) -> bool:
        """Wait ``seconds``; True unless the job's output ended meanwhile."""
        with self._cond:
            return not self._cond.wait_for(lambda: self.eof, max(0.0, seconds))

    def snapshot(self) -> list[_Step]:
        """A copy of the step records parsed so far."""
        with self._cond:
            return list(self.steps)

    def why(self) -> str:
        """A short account of the job's state, for log lines."""
        with self._cond:
            state = "output ended" if self.eof else "still running"
            tail = " | ".join(list(self.tail)[-4:])
        return f"{state}; exit code {self._proc.poll()}; last lines: {tail}"

    def worker_pid(self, rank: int) -> int:
        """PID of the Python worker that horovodrun launched with ``HOROVOD_RANK=rank``."""
        found = []
        for pid in _tagged_pids(self.tag):
            argv = _proc_file(pid, "cmdline")
            if len(argv) < 2 or Path(argv[0]).name in _SHELLS or str(WORKLOAD) not in argv[1:]:
                continue
            environ = _proc_file(pid, "environ")
            if f"HOROVOD_RANK={rank}" in environ:
                found.append(pid)
        if len(found) != 1:
            raise RuntimeError(f"expected one worker process of rank {rank}, found {found}")
        return found[0]

    def stop(self) -> None:
        """SIGKILL horovodrun's process group and every process group of the job; reap."""
        own_group = os.getpgrp()
        for _ in range(2):  # a second sweep catches processes spawned during the first
            pids = set(_tagged_pids(self.tag))
            groups = {self._proc.pid}
            for pid in pids:
                with contextlib.suppress(OSError):
                    groups.add(os.getpgid(pid))
            for group in groups - {own_group}:
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _log(f"horovodrun (pid {self._proc.pid}) did not exit after SIGKILL")
        self._reader.join(timeout=30)
        if self._proc.stdout is not None and not self._reader.is_alive():
            self._proc.stdout.close()


def _discovery_script(directory: Path, hosts: Sequence[str]) -> Path:
    """Write an executable host discovery script that prints ``host:1`` per host."""
    script = directory / "discover_hosts.sh"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {host}:1\n" for host in hosts))
    script.chmod(0o755)
    return script


def _recovery_trial(trial: int, np_: int, gloo_timeout: float | None, params: int) -> float | None:
    """One elastic trial: seconds from SIGKILL of a worker until all survivors step again."""
    aliases = local_host_aliases()
    if len(aliases) < np_:
        raise ValueError(f"need {np_} local host aliases for {np_} workers, found {aliases}")
    extra_env = {}
    if gloo_timeout is not None:  # horovod reads whole seconds
        extra_env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(max(1, math.ceil(gloo_timeout)))
    with tempfile.TemporaryDirectory(prefix="horovodrun-baseline-") as tmp:
        args = [
            "-np", str(np_),
            "--min-np", str(max(1, np_ - 1)),
            "--max-np", str(np_),
            "--host-discovery-script", str(_discovery_script(Path(tmp), aliases[:np_])),
            "--gloo",
            sys.executable, str(WORKLOAD),
            "--steps", str(MANY_STEPS),
            "--params", str(params),
        ]  # fmt: skip
        with _HorovodRunJob(args, extra_env) as job:
            if trial == 0:
                _log("elastic: " + " ".join(job.command) + f"  (hosts {aliases[:np_]})")
            warm = job.wait_for(
                lambda: all(job.counts[rank, np_] >= WARMUP_STEPS for rank in range(np_)),
                STARTUP_LIMIT_S,
            )
            if not warm:
                _log(f"trial {trial}: no warm-up at size {np_}: {job.why()}")
                return None
            victim = np_ - 1
            pid = job.worker_pid(victim)
            mark = len(job.snapshot())
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            survivors = set(range(np_ - 1))
            first: dict[int, float] = {}

            def recovered() -> bool:
                nonlocal mark
                for step in job.steps[mark:]:
                    if step.size == np_ - 1 and step.rank in survivors:
                        first.setdefault(step.rank, step.arrived)
                mark = len(job.steps)
                return set(first) == survivors

            if not job.wait_for(recovered, RECOVERY_LIMIT_S):
                _log(
                    f"trial {trial}: survivors did not step at size {np_ - 1} within "
                    f"{RECOVERY_LIMIT_S:.0f} s of killing rank {victim} (pid {pid}); "
                    f"stepped again: {sorted(first)}; {job.why()}"
                )
                return None
            offsets = ", ".join(f"rank {r} +{first[r] - killed_at:.3f} s" for r in sorted(first))
            _log(
                f"trial {trial}: killed rank {victim} (pid {pid}); first steps at size "
                f"{np_ - 1}: {offsets}"
            )
            return max(first.values()) - killed_at


def horovodrun_elastic_recovery(
    trials: int, np_: int = 3, gloo_timeout: float | None = None, params: int = 100_000
) -> list[float | None]:
    """Seconds from SIGKILL of one worker until every survivor steps at size ``np_ - 1``.

    Elastic ``horovodrun`` (Gloo) on this machine, one host alias per worker; one value per
    trial, None where the survivors did not step again within ``RECOVERY_LIMIT_S`` or the job
    died. ``gloo_timeout`` sets ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (whole seconds, rounded up).
    """
    if np_ < 2:
        raise ValueError("np_ must be at least 2: one worker is killed")
    results: list[float | None] = []
    for trial in range(trials):
        result = _recovery_trial(trial, np_, gloo_timeout, params)
        _log(f"elastic trial {trial}: " + ("failed" if result is None else f"{result:.3f} s"))
        results.append(result)
    return results


def horovodrun_static_throughput(seconds: float, np_: int = 2, params: int = 1_000_000) -> float:
    """Rank-0 steps per second of static ``horovodrun --gloo -np np_ -H localhost:np_``.

    Skips warm-up (the first ``WARMUP_STEPS`` steps and ``WARMUP_SECONDS`` after the first
    step), then counts rank 0's step lines arriving within the next ``seconds`` seconds.
    """
    args = [
        "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
        sys.executable, str(WORKLOAD),
        "--steps", str(MANY_STEPS),
        "--params", str(params),
    ]  # fmt: skip
    with _HorovodRunJob(args) as job:
        _log("static: " + " ".join(job.command))
        if not job.wait_for(lambda: job.counts[0, np_] >= WARMUP_STEPS, STARTUP_LIMIT_S):
            raise RuntimeError(f"rank 0 did not warm up: {job.why()}")
        first = next(s.arrived for s in job.snapshot() if s.rank == 0)
        start = max(time.monotonic(), first + WARMUP_SECONDS)
        end = start + seconds
        if not job.alive_after(end - time.monotonic()):
            raise RuntimeError(f"job ended during the measurement: {job.why()}")
        count = sum(1 for s in job.snapshot() if s.rank == 0 and start < s.arrived <= end)
    return count / seconds


def main() -> None:
    """Self-check: one recovery trial and a short throughput run; prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--np", type=int, default=3, dest="np_")
    parser.add_argument("--gloo-timeout", type=float, default=None)
    args = parser.parse_args()
    print(f"local host aliases: {local_host_aliases()}", flush=True)
    recovery = horovodrun_elastic_recovery(args.trials, args.np_, args.gloo_timeout)
    shown = ", ".join("failed" if r is None else f"{r:.3f}" for r in recovery)
    print(f"horovodrun elastic recovery (np={args.np_}) seconds: [{shown}]", flush=True)
    rate = horovodrun_static_throughput(args.seconds)
    print(f"horovodrun static throughput (np=2): {rate:.2f} steps/s", flush=True)


if __name__ == "__main__":
    main()
