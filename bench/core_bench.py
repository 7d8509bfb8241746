"""Elastic core figures, side by side with horovodrun, in one run (prints; never asserts).

1. Crash recovery: SIGKILL of one of 3 ranks -> every survivor has completed a step at size 2.
   `elastic-run` vs `horovodrun`'s elastic mode (default Gloo timeout, and 5 s), N trials each.
2. Steady throughput at 2 ranks: steps/s of `elastic-run` vs static `horovodrun --gloo`,
   alternating A/B, and the ratio.

The workload is bench/scripts/hvd_steps.py (a plain Horovod elastic script, ~1 M parameters
for throughput, ~100 k for recovery). Usage: python bench/core_bench.py [--trials N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastic_allreduce.store import EmbeddedEtcd, EtcdStore

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = str(ROOT / "bench" / "scripts" / "hvd_steps.py")
ELASTIC_RUN = str(Path(sys.executable).parent / "elastic-run")
_PREFIXED = re.compile(r"^\[\S+ e[-\d]+ r[-\d]+ (?P<slot>\S+)\] (?P<json>\{.*\})$")


class Output:
    """Lines of a process, each with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.steps: list[tuple[float, str, dict[str, int]]] = []
        self._arrivals: queue.Queue[None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = _PREFIXED.match(line.strip())
            if match:
                data = json.loads(match.group("json"))
                if data.get("event") == "step":
                    self.steps.append((time.monotonic(), match.group("slot"), data))
                    self._arrivals.put(None)
        self._arrivals.put(None)

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                return predicate()
            with contextlib.suppress(queue.Empty):
                self._arrivals.get(timeout=min(remaining, 0.5))
        return True


def _start(etcd: EmbeddedEtcd, job_id: str, workers: int, params: int) -> Output:
    command = [
        ELASTIC_RUN,
        *("--etcd", etcd.endpoints_text, "--job-id", job_id),
        *("--workers", str(workers), "--max-restarts", "0"),
        *("--", "python", WORKLOAD, "--steps", "1000000", "--params", str(params)),
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    return Output(proc)


def _stop(output: Output) -> None:
    if output.proc.poll() is None:
        os.killpg(output.proc.pid, signal.SIGTERM)
        try:
            output.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(output.proc.pid, signal.SIGKILL)
            output.proc.wait(timeout=10)


def elastic_run_recovery(etcd: EmbeddedEtcd, trial: int, params: int = 100_000) -> float | None:
    """SIGKILL one of 3 ranks; seconds until every survivor completed a step at size 2."""
    job_id = f"bench-recovery-{os.getpid()}-{trial}"
    output = _start(etcd, job_id, 3, params)
    try:

        def warmed() -> bool:
            counts: dict[str, int] = {}
            for _, slot, data in output.steps:
                if data["size"] == 3:
                    counts[slot] = counts.get(slot, 0) + 1
            return len(counts) == 3 and min(counts.values()) >= 20

        if not output.wait_until(warmed, 120):
            print(f"  elastic-run trial {trial}: did not warm up", file=sys.stderr)
            return None
        victim = next(slot for _, slot, data in reversed(output.steps) if data["rank"] == 1)
        with EtcdStore(etcd.endpoints_text, job_id) as store:
            kv = store.get(f"procs/{victim}")
            assert kv is not None and isinstance(kv.value, dict)
            pid = int(kv.value["pid"])  # type: ignore[arg-type]
        survivors = {slot for _, slot, _ in output.steps} - {victim}
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        first: dict[str, float] = {}

        def recovered() -> bool:
            for at, slot, data in output.steps:
                if at > killed_at and data["size"] == 2 and slot in survivors:
                    first.setdefault(slot, at)
            return set(first) == survivors

        if not output.wait_until(recovered, 120):
            print(f"  elastic-run trial {trial}: survivors did not step again", file=sys.stderr)
            return None
        return max(first.values()) - killed_at
    finally:
        _stop(output)


def elastic_run_throughput(
    etcd: EmbeddedEtcd, seconds: float, run: int, params: int = 1_000_000
) -> float:
    """Steps per second of rank 0 at 2 ranks, after a warm-up of 20 steps."""
    output = _start(etcd, f"bench-throughput-{os.getpid()}-{run}", 2, params)
    try:

        def rank0_steps() -> list[float]:
            return [at for at, _, data in output.steps if data["rank"] == 0]

        if not output.wait_until(lambda: len(rank0_steps()) >= 20, 120):
            raise RuntimeError("elastic-run did not warm up")
        start = rank0_steps()[-1]
        output.wait_until(lambda: rank0_steps()[-1] - start >= seconds, seconds + 60)
        window = [at for at in rank0_steps() if at > start]
        return len(window) / (window[-1] - start)
    finally:
        _stop(output)


def _summary(values: list[float | None]) -> str:
    done = sorted(v for v in values if v is not None)
    failed = len(values) - len(done)
    if not done:
        return f"no trial recovered ({failed} failed)"
    median = statistics.median(done)
    text = f"median {median:7.3f} s  min {done[0]:7.3f}  max {done[-1]:7.3f}  (n={len(done)})"
    return text + (f", {failed} did not recover" if failed else "")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trials", type=int, default=5, help="recovery trials per launcher (default 5)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="A/B throughput rounds (default 3)")
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="throughput window (default 20)"
    )
    args = parser.parse_args()
    from bench.horovodrun_baseline import (  # noqa: PLC0415 - needs the project root on sys.path
        horovodrun_elastic_recovery,
        horovodrun_static_throughput,
    )

    print(
        f"elastic-allreduce core benchmark, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    with EmbeddedEtcd() as etcd:
        ours = [elastic_run_recovery(etcd, trial) for trial in range(args.trials)]
        print(
            f"SIGKILL -> survivors stepping at size 2, elastic-run:        {_summary(ours)}",
            flush=True,
        )
        theirs = horovodrun_elastic_recovery(args.trials, np_=3)
        print(
            f"SIGKILL -> survivors stepping at size 2, horovodrun elastic: {_summary(theirs)}",
            flush=True,
        )
        short = horovodrun_elastic_recovery(args.trials, np_=3, gloo_timeout=5)
        print(
            f"  the same, horovodrun with HOROVOD_GLOO_TIMEOUT_SECONDS=5: {_summary(short)}",
            flush=True,
        )
        a, b = [], []
        for run in range(args.rounds):
            a.append(elastic_run_throughput(etcd, args.seconds, run))
            b.append(horovodrun_static_throughput(args.seconds, np_=2))
            print(
                f"  round {run}: elastic-run {a[-1]:.2f} steps/s, "
                f"horovodrun static {b[-1]:.2f} steps/s",
                flush=True,
            )
        ratio = statistics.median(a) / statistics.median(b)
        print(
            f"steady steps/s at 2 ranks: elastic-run {statistics.median(a):.2f}, static horovodrun "
            f"{statistics.median(b):.2f}, ratio {ratio:.3f} (median of {args.rounds} A/B rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
