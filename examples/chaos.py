"""`make chaos`: the CNN digits example without faults, then under chaos; accuracies compared.

Both runs use `elastic-run --standalone` with 2 workers, the same seed and 30 epochs (so that
the changes land while it trains). The chaos run kills a training process (SIGKILL) three times
-- each time once the job trains at 2 ranks or more, so a holder of the committed state always
survives -- and two more workers join with `elastic-run join`. With a fixed global batch and
exactly-once data the chaos run must end within one accuracy point of the clean run, and the
sample audit must find every digit used exactly once per epoch. Prints the figures; exit 0
when both hold.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from demo import BIN, ROOT, Output, _victim, banner, rank0_report, start_joiner


def reached(epoch: int, min_ranks: int = 1):
    def check(line: str) -> bool:
        data = rank0_report(line)
        return bool(data) and data["epoch"] >= epoch and data["ranks"] >= min_ranks

    return check


def run(epochs: int, chaos: bool) -> tuple[float, float, int, list[str]]:
    """One job; returns (accuracy, seconds, audit exit code, membership lines)."""
    audit = Path(tempfile.mkdtemp(prefix="elastic-allreduce-chaos-audit-"))
    env = {**os.environ, "ELASTIC_ALLREDUCE_SAMPLE_LOG": str(audit)}
    command = [
        str(BIN / "elastic-run"),
        *("--standalone", "--workers", "2", "--max-workers", "4", "--max-restarts", "3"),
        *("--", "python", str(ROOT / "examples" / "cnn_digits.py"), "--epochs", str(epochs)),
    ]
    banner(("chaos" if chaos else "clean") + " run: " + " ".join(command[1:]))
    started = time.monotonic()
    lines = Output()
    job = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    lines.follow(job)
    joiners: list[subprocess.Popen[str]] = []
    try:
        first = lines.wait_for(lambda s: s.startswith("elastic-run: job "), 60, "the start", job)
        job_id, etcd = first.split()[2], first.split()[-1]
        if chaos:
            for action, epoch in [
                ("kill", 3),
                ("join", 6),
                ("kill", 12),
                ("join", 15),
                ("kill", 21),
            ]:
                ranks = 2 if action == "kill" else 1
                lines.wait_for(reached(epoch, ranks), 300, f"epoch {epoch} at {ranks}+ ranks", job)
                if action == "kill":
                    slot, pid = _victim(etcd, job_id)
                    banner(f"SIGKILL to the training process of slot {slot} (pid {pid})")
                    os.kill(pid, signal.SIGKILL)
                    lines.wait_for(lambda s, slot=slot: f"slot {slot} crashed" in s, 60, "", job)
                else:
                    banner("one more worker joins: elastic-run join")
                    joiners.append(start_joiner(etcd, job_id, env, lines))
        code = job.wait(timeout=600)
        for joiner in joiners:
            joiner.wait(timeout=60)
    finally:
        for proc in (job, *joiners):
            if proc.poll() is None:
                proc.terminate()
    seconds = time.monotonic() - started
    if code != 0:
        raise SystemExit(f"chaos: the {'chaos' if chaos else 'clean'} job failed ({code})")
    accuracy = float(next(s for s in reversed(lines) if "final test accuracy:" in s).split()[-1])
    from sklearn.datasets import load_digits

    samples = int(0.8 * len(load_digits().images))
    checker = [sys.executable, "-m", "elastic_allreduce.training.audit", str(audit)]
    verdict = subprocess.run(
        [*checker, "--samples", str(samples), "--epochs", str(epochs)],
        check=False,
        cwd=ROOT,
    )
    changes = [
        line.split("launcher] ", 1)[-1]
        for line in lines
        if "launcher]" in line and any(w in line for w in ("joined", "crashed", "running with"))
    ]
    return accuracy, seconds, verdict.returncode, changes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    clean, clean_s, clean_audit, _ = run(args.epochs, chaos=False)
    chaotic, chaos_s, chaos_audit, changes = run(args.epochs, chaos=True)
    banner("figures")
    kills = sum("crashed" in line for line in changes)
    joins = sum("joined" in line for line in changes)
    print(f"membership changes in the chaos run: {kills} crashes, {joins} joins")
    for line in changes:
        print("  " + line)
    print(f"clean run: final test accuracy {clean:.4f} in {clean_s:.0f} s")
    print(f"chaos run: final test accuracy {chaotic:.4f} in {chaos_s:.0f} s")
    print(f"difference: {100 * (chaotic - clean):+.2f} accuracy points")
    print(f"sample audit: clean exit {clean_audit}, chaos exit {chaos_audit}")
    good = abs(chaotic - clean) <= 0.01 and clean_audit == 0 and chaos_audit == 0
    banner("within one accuracy point, every digit exactly once" if good else "MISSED (see above)")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
