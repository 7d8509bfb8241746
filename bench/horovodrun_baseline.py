"""Baseline figures for Horovod's own launcher, ``horovodrun`` (Gloo, this machine only).

1. ``horovodrun_elastic_recovery``: elastic ``horovodrun`` with np workers; SIGKILL one non-zero
   rank and time until every survivor steps again at the smaller size.
2. ``horovodrun_static_throughput``: static ``horovodrun --gloo``; rank-0 steps per second.
3. ``horovodrun_static_slowed``: the same, before and after one worker is held to a CPU quota
   (the straggler scenario: static Horovod has no way to notice or drop it).

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
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench import cgroups
from bench.jobs import (
    STARTUP_LIMIT_S,
    BenchError,
    HorovodRunJob,
    first_steps,
    log,
    step_rate,
    summarize,
)

WORKLOAD = Path(__file__).resolve().parent / "scripts" / "hvd_steps.py"
MANY_STEPS = 1_000_000_000  # never reached within a trial
WARMUP_STEPS = 20  # steps each rank must print before measuring
RECOVERY_LIMIT_S = 90.0
TAG_VAR = "HVD_BASELINE_TAG"  # marks every process of one job, for the clean-up
_HOST_NAME = re.compile(r"^[\w.-]+$")  # what horovod's host parsing accepts
_SHELLS = frozenset({"sh", "bash", "dash", "env"})


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


class _TaggedHorovodRun(HorovodRunJob):
    """A ``horovodrun`` job whose every process carries ``TAG_VAR`` in its environment.

    horovodrun starts workers in process groups of their own: the tag finds them all, for the
    victim's pid and for the clean-up.
    """

    def __init__(self, args: Sequence[str], extra_env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex
        super().__init__([_horovodrun(), *args], {**(extra_env or {}), TAG_VAR: self.tag})

    def steps_at(self, rank: int, size: int) -> int:
        """Step records of ``rank`` at ``size`` so far (call under the job's lock)."""
        return sum(
            1
            for r in self.records
            if r.event == "step" and r.data.get("rank") == rank and r.data.get("size") == size
        )

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
            raise BenchError(f"expected one worker process of rank {rank}, found {found}")
        return found[0]

    def stop(self) -> None:
        """SIGKILL horovodrun's process group and every process group of the job; reap."""
        own_group = os.getpgrp()
        for _ in range(2):  # a second sweep catches processes spawned during the first
            pids = set(_tagged_pids(self.tag))
            groups = {self.proc.pid}
            for pid in pids:
                with contextlib.suppress(OSError):
                    groups.add(os.getpgid(pid))
            for group in groups - {own_group}:
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        super().stop()


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
        raise BenchError(f"need {np_} local host aliases for {np_} workers, found {aliases}")
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
        with _TaggedHorovodRun(args, extra_env) as job:
            if trial == 0:
                log("horovodrun elastic: " + " ".join(job.command) + f"  (hosts {aliases[:np_]})")
            try:
                job.wait_for(
                    lambda: all(job.steps_at(rank, np_) >= WARMUP_STEPS for rank in range(np_)),
                    STARTUP_LIMIT_S,
                    f"every rank to warm up at size {np_}",
                )
                victim = np_ - 1
                pid = job.worker_pid(victim)
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                first = first_steps(
                    job,
                    killed_at,
                    np_ - 1,
                    members=set(range(np_ - 1)),
                    key=lambda r: r.data.get("rank"),
                    timeout=RECOVERY_LIMIT_S,
                )
            except BenchError as exc:
                log(f"horovodrun trial {trial}: {exc}")
                return None
            offsets = ", ".join(f"rank {r} +{first[r] - killed_at:.3f} s" for r in sorted(first))
            log(f"horovodrun trial {trial}: killed rank {victim} (pid {pid}); {offsets}")
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
    return [_recovery_trial(trial, np_, gloo_timeout, params) for trial in range(trials)]


def _static_args(np_: int, params: int) -> list[str]:
    """horovodrun's arguments for a static job of ``np_`` workers on this machine."""
    return [
        "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
        sys.executable, str(WORKLOAD),
        "--steps", str(MANY_STEPS),
        "--params", str(params),
    ]  # fmt: skip


def horovodrun_static_throughput(
    seconds: float,
    np_: int = 2,
    params: int = 1_000_000,
    env: dict[str, str] | None = None,
    settle_s: float = 3.0,
) -> dict[str, float]:
    """Rank-0 steps per second of static ``horovodrun --gloo -np np_ -H localhost:np_``.

    Measured by :func:`bench.jobs.step_rate`, exactly as for ``elastic-run`` (steps/s and the
    CPU used by the workers and by horovodrun's own processes).
    """
    with _TaggedHorovodRun(_static_args(np_, params), env) as job:
        log("horovodrun static: " + " ".join(job.command))
        return step_rate(job, seconds, np_, settle_s=settle_s)


def horovodrun_static_slowed(
    seconds: float, np_: int, params: int, percent: int, slowed_rank: int
) -> dict[str, float]:
    """Rank 0's steps per second of static ``horovodrun --gloo -np np_``: ``clean`` over
    ``seconds``, then ``slowed`` over ``seconds`` once ``slowed_rank`` is held to ``percent`` %
    of a CPU (a cgroup quota, removed at the end)."""
    with _TaggedHorovodRun(_static_args(np_, params)) as job:
        log("horovodrun static, one worker slowed: " + " ".join(job.command))
        clean = step_rate(job, seconds, np_, settle_s=3.0)
        with cgroups.cpu_quota(job.worker_pid(slowed_rank), percent, name="bench-horovodrun"):
            job.wait_seconds(3.0)  # the ring's pace follows the slowed worker
            start = time.monotonic()
            job.wait_seconds(seconds)
            steps = [
                r
                for r in job.snapshot("step")
                if r.data.get("rank") == 0 and start < r.arrived <= start + seconds
            ]
    return {"clean": clean["steps_per_s"], "slowed": len(steps) / seconds}


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
    print(f"horovodrun elastic recovery (np={args.np_}): {summarize(recovery)}", flush=True)
    rate = horovodrun_static_throughput(args.seconds)
    print(f"horovodrun static throughput (np=2): {rate}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
