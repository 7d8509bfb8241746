"""The examples end to end: `make demo` (the CNN with a join and a kill, accuracy and the
audit) and the NLP language model under `elastic-run`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import ROOT
from tests.integration.harness import start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_the_demo_trains_through_a_join_and_a_kill_to_a_good_accuracy() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    output = result.stdout
    assert result.returncode == 0, output[-5000:]
    assert "joined" in output and "crashed: killed by SIGKILL" in output
    accuracy = float(output.split("\nfinal test accuracy: ", 1)[1].split()[0])
    assert accuracy >= 0.95
    assert output.count("0 missing, 0 duplicated: ok") == 12
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
