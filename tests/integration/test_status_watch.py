"""`elastic-run status --watch` in a real pseudo-terminal (tmux), and `status --json`, on a
real job (real etcd, Horovod/Gloo, processes and signals)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import ROOT
from tests.integration.harness import ELASTIC_RUN, Job, run_cli, slot_of_rank, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(ROOT / "tests" / "scripts" / "hang_at_step.py")
STEPS = 900


@contextlib.contextmanager
def terminal(name: str, command: list[str]) -> Iterator[str]:
    """``command`` in a detached tmux session of 120x40 (a real pseudo-terminal); its name."""
    tmux = shutil.which("tmux")
    assert tmux is not None, "tmux is not installed: `make setup` installs it"
    subprocess.run(
        [tmux, "new-session", "-d", "-s", name, "-x", "120", "-y", "40", *command], check=True
    )
    try:
        yield name
    finally:
        subprocess.run([tmux, "kill-session", "-t", name], check=False, capture_output=True)


def screen(name: str) -> str:
    shown = subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True, check=False
    )
    return shown.stdout


def wait_for_screen(name: str, job: Job, wanted: str, timeout: float) -> str:
    """The screen once it shows ``wanted`` (checked as the job's output arrives)."""
    seen = [""]

    def shows() -> bool:
        seen[0] = screen(name)
        return wanted in seen[0]

    try:
        job.wait_for(shows, timeout, f"{wanted!r} on the screen")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nscreen:\n{seen[0]}") from None
    return seen[0]


def test_status_watch_shows_the_ring_change_live_and_json_has_the_ranks(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0"),
        script=SCRIPT,
        script_args=("--steps", str(STEPS), "--step-delay", "0.02"),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    watch = [ELASTIC_RUN, "status", "--watch", "--etcd", etcd_server.endpoints_text]
    with terminal(f"watch-{os.getpid()}", [*watch, "--job-id", job.job_id]) as name:
        before = wait_for_screen(name, job, "3 ranks (running", 30)
        assert f"/{STEPS}, ETA " in wait_for_screen(name, job, f"/{STEPS}, ETA", 30)
        assert "job " + job.job_id in before
        victim = slot_of_rank(job, 2, 3)
        assert victim in rank_rows(before)
        os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
        after = wait_for_screen(name, job, "2 ranks (running, cause failure)", 30)
        assert victim not in rank_rows(after), after
        status: dict[str, Any] = {}

        def json_has_the_new_ranks() -> bool:
            shown = run_cli(
                "status", "--json", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id
            )
            assert shown.returncode == 0, shown.stderr
            status.update(json.loads(shown.stdout))
            return all("total_steps" in rank for rank in status["ranks"])

        # The members' progress of the new epoch arrives within a few seconds.
        job.wait_for(json_has_the_new_ranks, 30, "the new epoch's ranks in status --json")
        assert status["status"]["phase"] == "running"
        assert [r["slot"] for r in status["ranks"]] == [
            slot for slot in rank_rows(before) if slot != victim
        ]
        assert all(r["total_steps"] == STEPS and r["step"] > 0 for r in status["ranks"]), status
        assert job.finish(180) == 0, job.tail()
        # The view ends with the job: the terminal's command exits, and the session with it.
        ended = threading.Event()
        deadline = time.monotonic() + 15
        while not ended.wait(0.2) and session_alive(name):
            assert time.monotonic() < deadline, "status --watch did not end with the job"


def rank_rows(shown: str) -> list[str]:
    """The slots of the ranks table, in rank order."""
    rows = [re.match(r"^\s*(\d+)\s+([a-z0-9-]+\.\d+)", line) for line in shown.splitlines()]
    return [row.group(2) for row in rows if row is not None]


def session_alive(name: str) -> bool:
    alive = subprocess.run(["tmux", "has-session", "-t", name], check=False, capture_output=True)
    return alive.returncode == 0
