"""`make demo` end to end: the CNN example with a join and a kill, accuracy and the audit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

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
