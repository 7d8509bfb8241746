"""The examples end to end: `make demo` (the CNN with a join and a kill, accuracy and the
audit) and the NLP language model under `elastic-run`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import ROOT
from tests.helpers import leftovers
from tests.integration.harness import start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Seconds the demo may run; below the test's timeout, so that the test itself ends it.
DEMO_TIMEOUT = 270


def run_demo(scratch: Path) -> tuple[int, str]:
    """Run `examples/demo.py` with its temp folders inside ``scratch``; its exit code and
    output. Whatever happens (a timeout, the test's own timeout), its whole process group and
    every process it started (agents and training processes run in sessions of their own; all
    carry this run's tag) are ended before this returns or raises."""
    tag = leftovers.new_token()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch), leftovers.TEST_MARKER: tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def tagged() -> list[leftovers.Leftover]:
        return leftovers.find_processes(leftovers.TEST_MARKER, tag)

    try:
        try:
            output, _ = proc.communicate(timeout=DEMO_TIMEOUT)
        except subprocess.TimeoutExpired:
            leftovers.end_process_tree(proc.pid)
            leftovers.kill_all(tagged)
            output, _ = proc.communicate(timeout=30)  # every writer of the pipe is gone
            pytest.fail(f"the demo did not finish within {DEMO_TIMEOUT} s:\n{output[-5000:]}")
        return proc.returncode, output
    finally:
        left = leftovers.end_process_tree(proc.pid, with_descendants=proc.returncode is None)
        left += leftovers.kill_all(tagged)
        if proc.returncode is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        assert not left, "processes of the demo outlived SIGKILL: " + "; ".join(map(str, left))


def test_the_demo_trains_through_a_join_and_a_kill_to_a_good_accuracy() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="elastic-allreduce-demo-test-"))
    try:
        code, output = run_demo(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert code == 0, output[-5000:]
    assert "joined" in output and "crashed: killed by SIGKILL" in output
    assert "=== demo: the job trains on at 2 ranks:" in output, output[-5000:]
    accuracy = float(output.split("\nfinal test accuracy: ", 1)[1].split()[0])
    assert accuracy >= 0.95
    # 12 epochs, or more where the demo held training until its join and kill had landed.
    epochs = int(output.split("exactly once in each of the ", 1)[1].split()[0])
    assert epochs >= 12
    assert output.count("0 missing, 0 duplicated: ok") == epochs
    assert output.rstrip().endswith("=== demo: all good")


def test_the_nlp_example_beats_the_unigram_baseline_under_elastic_run(
    etcd_server: EmbeddedEtcd,
) -> None:
    job = start_job(
        etcd_server,
        "--workers",
        "2",
        script=str(ROOT / "examples" / "nlp_text.py"),
        script_args=("--max-chars", "300000", "--steps", "80", "--units", "96"),
    )
    try:
        assert job.finish(timeout=240) == 0, job.tail()
    finally:
        job.stop()
    finals = [line for line in job.lines if "final validation perplexity:" in line]
    assert len(finals) == 2, job.tail()  # every rank reports the same model
    perplexity = float(finals[0].split("perplexity: ", 1)[1].split()[0])
    baseline = float(finals[0].rsplit("baseline ", 1)[1].rstrip(")"))
    assert {line.split("] ", 1)[1] for line in finals} == {finals[0].split("] ", 1)[1]}
    assert perplexity < 0.6 * baseline, finals[0]
