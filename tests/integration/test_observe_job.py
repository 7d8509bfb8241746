"""A real job seen from outside: /metrics scraped over HTTP through a SIGKILL and a join, the
dashboard page rendered by a real headless browser, the events file drawn as a timeline."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import read_job
from elastic_allreduce.store import EmbeddedEtcd
from launcher.observe.events import read_events
from launcher.observe.timeline import render_file
from tests.integration.harness import EA_SCRIPT, Job, join_job, slot_of_rank, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = ("--steps", "400", "--commit-every", "5", "--step-delay", "0.03")
#: Set to a folder to keep the test's dashboard screenshot and timeline there (docs/).
PICTURES = "ELASTIC_ALLREDUCE_TEST_PICTURES"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - http only
        body: bytes = reply.read()
        return body


def metrics(dashboard: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = _get(f"http://{dashboard}/metrics").decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def changes(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], kind: str) -> float:
    return values[("elastic_membership_changes_total", (("kind", kind),))]


def browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render_page(url: str, screenshot: Path) -> str:
    """The dashboard's DOM after its script ran, as a headless Chromium sees it."""
    chromium = browser()
    assert chromium is not None
    common = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=4000",
        "--window-size=1280,900",
    ]
    dom = subprocess.run(
        [*common, "--dump-dom", url], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    # On a loaded machine Chromium now and then exits 0 without writing the screenshot: up to
    # three tries, then the test fails with what it said.
    for _ in range(3):
        shot = subprocess.run(
            [*common, f"--screenshot={screenshot}", url],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        if screenshot.is_file():
            break
    assert screenshot.is_file(), shot.stderr[-2000:]
    return dom


def test_metrics_dashboard_and_timeline_follow_a_kill_and_a_join(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    events_file = tmp_path / "events.jsonl"
    # The ring holds at its commits from step 15 until the test lets it go: on a loaded machine
    # the lone survivor finished all its steps before the restarted process and the joiner had
    # imported TensorFlow (CI, TF 2.21), and size 3 never came.
    hold = tmp_path / "hold"
    hold.touch()
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-workers", "3", "--max-restarts", "1"),
        *("--metrics-port", "0", "--events-file", str(events_file)),
        script=EA_SCRIPT,  # ea.State reports each commit (status/progress)
        script_args=(*TRAIN, "--hold-file", str(hold), "--hold-at", "15"),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 3, 120, "commits at size 2")
    leader = read_job(job.store).leader
    assert leader is not None and leader.record.dashboard is not None
    dashboard = leader.record.dashboard
    before = metrics(dashboard)
    assert before[("elastic_ring_size", ())] == 2
    assert changes(before, "Crashed") == 0 and changes(before, "Joined") == 2

    victim = slot_of_rank(job, 1, 2)
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    joiner = join_job(etcd_server, job)
    jobs.append(joiner)

    def held_at_3() -> set[str]:
        """The slots holding at size 3 (the joiner's output is its own)."""
        return {
            e.slot
            for e in (*job.events, *joiner.events)
            if e.data.get("event") == "held" and e.data["size"] == 3
        }

    job.wait_for(lambda: len(held_at_3()) == 3, 150, "the ring of 3 to hold")
    hold.unlink()
    job.wait_for(lambda: len(job.commits(3)) >= 3, 120, "commits at size 3")
    after = metrics(dashboard)
    assert changes(after, "Crashed") == 1
    # The two first members, the victim's restart and the joiner (one slot each).
    assert changes(after, "Joined") == 4
    assert after[("elastic_recoveries_total", (("cause", "failure"),))] >= 1
    assert after[("elastic_reform_seconds_count", (("cause", "failure"),))] >= 1
    assert after[("elastic_restarts_used", ())] == 1
    assert after[("elastic_ring_size", ())] == 3
    assert after[("elastic_last_commit_step", ())] > before[("elastic_last_commit_step", ())]
    status = json.loads(_get(f"http://{dashboard}/api/status"))
    ranks = [r["slot"] for r in status["ring"]["ranks"]]
    assert len(ranks) == 3 and victim in ranks
    # Goodput: kept step time grows; the steps lost to the rollback are those the survivor ran
    # past its last commit (its own count, steps_run - step, printed with each commit).
    assert 0 < after[("elastic_goodput_ratio", ())] <= 1
    assert after[("elastic_kept_step_seconds", ())] > before[("elastic_kept_step_seconds", ())]
    survivor = slot_of_rank(job, 0, 2)  # the victim was rank 1
    mine = [e for e in job.commits(3) if e.slot == survivor][-1].data
    lost = int(mine["steps_run"]) - int(mine["step"])
    deadline = time.monotonic() + 15  # the launcher hears of it with the next progress report
    while (shown := metrics(dashboard)[("elastic_rollback_steps", ())]) != lost:
        assert time.monotonic() < deadline, f"rollback steps: {shown}, the survivor lost {lost}"
        time.sleep(0.5)
    assert status["goodput"]["wall_seconds"] > 0

    chromium = browser()
    if chromium is None:
        print("no headless browser (Debian's chromium) here: the page was not rendered")
    else:
        screenshot = tmp_path / "dashboard.png"
        dom = render_page(f"http://{dashboard}/", screenshot)
        assert 'data-loaded="true"' in dom, dom[:2000]
        assert f"epoch {status['ring']['epoch']}" in dom
        for slot in ranks:
            assert f"<td>{slot}</td>" in dom, slot
        assert f"slot {victim} crashed: killed by SIGKILL" in dom
        assert "<td>Joined</td>" in dom and "<td>Crashed</td>" in dom
        assert re.search(r"goodput \d+\.\d %", dom), dom[:2000]
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get(PICTURES):
            shutil.copy(screenshot, Path(os.environ[PICTURES]) / "dashboard.png")

    assert job.finish() == 0, job.tail()
    events, skipped = read_events(events_file.read_text().splitlines())
    assert not skipped and events[-1].succeeded
    picture = tmp_path / "timeline.png"
    timeline, _ = render_file(events_file, picture)
    assert len(timeline.epochs) >= 3 and any(e[3] and len(e[3]) == 3 for e in timeline.epochs)
    if os.environ.get(PICTURES):
        shutil.copy(picture, Path(os.environ[PICTURES]) / "timeline-test.png")
