"""`make demo`: the CNN digits example under `elastic-run --standalone`, with a join and a kill.

It starts the job with 2 workers, adds a third with `elastic-run join` after two epochs, kills
one training process (SIGKILL) once the three train together, and lets the job finish. Epochs
last at least EPOCH_SECONDS, and training goes on past EPOCHS while the demo holds it
(`cnn_digits.py --hold-file`) until both changes have landed, however long the joiner takes to
start; the demo fails unless the job trained on at 2 ranks after the kill. It shows the
job's own output (every line names job, ring epoch, rank and slot), then the final accuracy and
the verdict of the sample audit: every digit used exactly once per epoch despite the changes.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from elastic_allreduce import logprefix

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EPOCHS = 12
#: The pace: 12 epochs take at least 18 s, the joiner's start (a TensorFlow import) a few.
EPOCH_SECONDS = 1.5


def banner(text: str) -> None:
    print(f"\n=== demo: {text}", flush=True)


class Output(list[str]):
    """Every line the job and the joiner printed, with a condition to wait for new ones."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Condition()

    def follow(self, proc: subprocess.Popen[str]) -> threading.Thread:
        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                print(raw, end="", flush=True)
                with self.arrived:
                    self.append(raw.rstrip("\n"))
                    self.arrived.notify_all()

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        return thread

    def wait_for(self, predicate, timeout: float, what: str, proc: subprocess.Popen[str]) -> str:
        deadline = time.monotonic() + timeout
        seen = 0
        with self.arrived:
            while True:
                for line in self[seen:]:
                    if predicate(line):
                        return line
                seen = len(self)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or proc.poll() is not None:
                    raise SystemExit(f"demo: gave up waiting for {what}")
                self.arrived.wait(min(remaining, 1.0))


def rank0_report(line: str) -> dict | None:
    """The JSON object that rank 0 printed on this output line, if it is one."""
    parsed = logprefix.parse_line(line)
    if parsed is None or parsed.rank != 0 or not parsed.text.startswith("{"):
        return None
    return json.loads(parsed.text)


def final_accuracy(line: str) -> float | None:
    """The accuracy in a training process's last line (`final test accuracy: <x>`), if it is one."""
    parsed = logprefix.parse_line(line)
    if parsed is None or not parsed.text.startswith("final test accuracy:"):
        return None
    return float(parsed.text.rsplit(":", 1)[-1])


def epoch_report(line: str, size: int | None = None, at_least: int = 0) -> bool:
    report = rank0_report(line)
    if report is None:
        return False
    return report.get("epoch", -1) >= at_least and (size is None or report.get("ranks") == size)


def start_joiner(etcd: str, job_id: str, env: dict[str, str], lines: Output):
    """`elastic-run join` for the job, its output followed into ``lines``."""
    joiner = subprocess.Popen(
        [str(BIN / "elastic-run"), "join", "--etcd", etcd, "--job-id", job_id],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    lines.follow(joiner)
    return joiner


def main() -> int:
    audit = Path(tempfile.mkdtemp(prefix="elastic-allreduce-demo-audit-"))
    env = {**os.environ, "ELASTIC_ALLREDUCE_SAMPLE_LOG": str(audit)}
    # Training goes on past EPOCHS while this file exists: removed once the story is told, so
    # that a slow joiner (a loaded machine) still joins and the kill still lands mid-training.
    hold = audit.parent / f"{audit.name}.hold"
    hold.touch()
    command = [
        str(BIN / "elastic-run"),
        *("--standalone", "--workers", "2", "--max-workers", "3", "--max-restarts", "0"),
        *("--", "python", str(ROOT / "examples" / "cnn_digits.py"), "--epochs", str(EPOCHS)),
        *("--min-epoch-seconds", str(EPOCH_SECONDS), "--hold-file", str(hold)),
    ]
    banner("starting 2 workers: " + " ".join(command[1:]))
    started = time.monotonic()
    lines = Output()
    job = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    reader = lines.follow(job)
    first = lines.wait_for(lambda s: s.startswith("elastic-run: job "), 60, "the job to start", job)
    job_id, etcd = first.split()[2], first.split()[-1]
    joiner = None
    try:
        lines.wait_for(lambda s: epoch_report(s, size=2, at_least=2), 120, "two epochs", job)
        banner("a third worker joins: elastic-run join")
        joiner = start_joiner(etcd, job_id, env, lines)
        at_three = lines.wait_for(lambda s: epoch_report(s, size=3), 120, "3 ranks", job)
        victim = _victim(etcd, job_id)
        banner(f"killing training process of slot {victim[0]} (pid {victim[1]}) with SIGKILL")
        os.kill(victim[1], signal.SIGKILL)
        after = (rank0_report(at_three) or {}).get("epoch", 0) + 1
        trained_on = lines.wait_for(
            lambda s: epoch_report(s, size=2, at_least=after), 120, "training on at 2 ranks", job
        )
        banner("the job trains on at 2 ranks: " + trained_on.split("] ", 1)[-1])
        hold.unlink()
        code = job.wait(timeout=300)
        joiner.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        hold.unlink(missing_ok=True)
        for proc in (job, joiner):
            if proc is not None and proc.poll() is None:
                proc.terminate()
    banner(f"job exit code {code} after {time.monotonic() - started:.0f} s")
    accuracy = next((a for a in map(final_accuracy, reversed(lines)) if a is not None), 0.0)
    print(f"final test accuracy: {accuracy:.4f}")
    for line in lines:
        if "launcher]" in line and any(w in line for w in ("joined", "crashed", "running with")):
            print("  " + line.split("launcher] ", 1)[-1])
    epochs = max((r.get("epoch", 0) for r in map(rank0_report, lines) if r), default=EPOCHS)
    banner(f"sample audit: every training digit exactly once in each of the {epochs} epochs?")
    from sklearn.datasets import load_digits

    samples = int(0.8 * len(load_digits().images))
    verdict = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_allreduce.training.audit",
            str(audit),
            "--samples",
            str(samples),
            "--epochs",
            str(epochs),
        ],
        check=False,
        cwd=ROOT,
    )
    good = code == 0 and verdict.returncode == 0 and accuracy >= 0.95
    banner("all good" if good else "something went wrong (see above)")
    return 0 if good else 1


def _victim(etcd: str, job_id: str) -> tuple[str, int]:
    """A training process that is not rank 0 of the current ring."""
    from elastic_allreduce.records.snapshot import read_job
    from elastic_allreduce.store import EtcdStore

    with EtcdStore(etcd, job_id) as store:
        job = read_job(store)
    assert job.ring is not None, "the job has no ring yet"
    slot = job.ring.record.slots[-1]
    assert slot in job.procs, f"{slot} has no process"
    return slot, job.procs[slot].record.pid


if __name__ == "__main__":
    sys.exit(main())
