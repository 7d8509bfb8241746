"""What `elastic-run status` shows (launcher.status_view), from a hand-made snapshot."""

from __future__ import annotations

from rich.console import Console

from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import parse_job
from elastic_allreduce.records.values import (
    JobPhase,
    JobStatus,
    RankProgress,
    RanksRecord,
    Ring,
    RingState,
)
from launcher import status_view
from tests.test_records import FakeKV

NOW = 1_700_000_100.0
RING = Ring(4, ("n0.0", "n1.0"), RingState.RUNNING, "h:1")
RANKS = RanksRecord(
    4,
    NOW - 1,
    (
        RankProgress("n0.0", 0, 1, 250, 300, 0.5, None, NOW - 2.0, 1000),
        RankProgress("n1.0", 1, 2, None, 0, None, "startup", None),
    ),
)


def view(ranks: RanksRecord = RANKS) -> status_view.StatusView:
    items = [
        FakeKV(keys.RING, RING.to_json()),
        FakeKV(keys.JOB_STATUS, JobStatus(JobPhase.RUNNING).to_json()),
        FakeKV(keys.RANKS, ranks.to_json()),
    ]
    return status_view.make_view("j1", parse_job(items, revision=3), (), None, NOW)


def test_each_rank_shows_its_step_how_long_ago_and_its_step_time() -> None:
    shown = view()
    assert status_view.rank_progress(shown.ranks["n0.0"], NOW) == (
        "step 250/1000, 2.0 s ago, 0.500 s/step"
    )
    assert status_view.rank_progress(shown.ranks["n1.0"], NOW) == "in startup"
    assert status_view.rank_progress(None, NOW) == ""


def test_the_eta_comes_from_rank_0s_step_time_and_declared_total() -> None:
    assert status_view.eta(view()) == (250, 1000, 375.0)
    undeclared = RanksRecord(4, NOW, (RankProgress("n0.0", 0, 1, 5, 5, 0.5, None, NOW),))
    assert status_view.eta(view(undeclared)) is None


def test_json_has_every_rank_with_its_progress() -> None:
    record = status_view.to_json(view())
    assert record["status"]["phase"] == "running" and record["ring"]["epoch"] == 4
    assert [(r["rank"], r["slot"], r.get("step")) for r in record["ranks"]] == [
        (0, "n0.0", 250),
        (1, "n1.0", None),
    ]


def test_the_live_view_draws_the_ring_the_bar_and_the_ranks() -> None:
    console = Console(width=100, record=True, color_system=None)
    console.print(status_view.render(view()))
    text = console.export_text()
    assert "job j1: running" in text
    assert "ring epoch 4, 2 ranks (running, cause start)" in text
    assert "step 250/1000, ETA 375 s" in text
    assert "n0.0" in text and "step 250/1000, 2.0 s ago, 0.500 s/step" in text


def test_progress_of_an_older_epoch_is_not_shown_as_the_current_rings() -> None:
    older = RanksRecord(3, NOW, RANKS.ranks)
    assert view(older).ranks == {}
