"""The goodput meter, step by step (pure: times are given)."""

from __future__ import annotations

import pytest

from elastic_allreduce.records.values import RankProgress
from launcher.observe.goodput import GoodputMeter


def rank(
    slot: str,
    seconds: float | None,
    *,
    rolled_back: int = 0,
    batch: int | None = None,
    inc: int = 1,
) -> RankProgress:
    return RankProgress(slot, 0, inc, None, 0, seconds, None, None, None, batch, rolled_back)


def test_kept_steps_count_their_step_time_and_the_first_commit_is_the_baseline() -> None:
    meter = GoodputMeter(started_at=100.0)
    assert meter.read(100.0).ratio is None
    meter.ranks([rank("a.0", 0.5, batch=64), rank("b.0", 0.5, batch=64)])
    meter.commit(10, 101.0)  # a job resumed at step 10: nothing kept yet
    assert meter.read(110.0).kept_seconds == 0.0
    meter.ranks([rank("a.0", 0.4), rank("b.0", 0.6)])
    meter.commit(20, 110.0)
    figures = meter.read(120.0)
    assert figures.kept_seconds == pytest.approx(10 * 0.5)
    assert figures.ratio == pytest.approx(5.0 / 20.0)
    assert figures.samples_per_second == pytest.approx(64 / 0.5)
    meter.commit(20, 112.0)  # the same commit seen again counts once
    meter.commit(15, 113.0)  # nor does an older one
    assert meter.read(120.0).kept_seconds == pytest.approx(5.0)


def test_the_ring_loses_what_its_survivors_rolled_back_once_per_failure() -> None:
    meter = GoodputMeter(started_at=0.0)
    meter.ranks([rank("a.0", 1.0), rank("b.0", 1.0), rank("c.0", 1.0)])
    meter.commit(0, 1.0)
    meter.commit(5, 6.0)
    # c.0 crashed; a.0 and b.0 each rolled back the 3 steps past the commit.
    meter.ranks([rank("a.0", 1.0, rolled_back=3), rank("b.0", 1.0, rolled_back=3)])
    figures = meter.read(20.0)
    assert (figures.rollback_steps, figures.rollback_seconds) == (3, 3.0)
    meter.ranks([rank("a.0", 2.0, rolled_back=3), rank("b.0", 2.0, rolled_back=3)])
    assert meter.read(20.0).rollback_steps == 3  # reported again: counted once
    # The restarted c.0 (a new incarnation) and a second failure of 2 steps.
    meter.ranks(
        [
            rank("a.0", 2.0, rolled_back=5),
            rank("b.0", 2.0, rolled_back=5),
            rank("c.0", 2.0, rolled_back=2, inc=2),
        ]
    )
    figures = meter.read(20.0)
    assert (figures.rollback_steps, figures.rollback_seconds) == (5, 3.0 + 2 * 2.0)
    meter.commit(10, 30.0)
    figures = meter.read(40.0)
    assert figures.kept_seconds == 5 * 1.0 + 5 * 2.0
    assert figures.ratio == pytest.approx(15.0 / 40.0)


def test_goodput_never_exceeds_one() -> None:
    meter = GoodputMeter(started_at=0.0)
    meter.ranks([rank("a.0", 10.0)])
    meter.commit(0, 0.0)
    meter.commit(100, 0.5)
    assert meter.read(1.0).ratio == 1.0


def test_without_step_times_the_pace_between_clean_commits_counts() -> None:
    """A script that only commits (no ea.report_step): kept time is the wall time per step
    between its last two commits with no rollback between them."""
    meter = GoodputMeter(started_at=0.0)
    meter.ranks([rank("a.0", None), rank("b.0", None)])
    meter.commit(0, 10.0)
    meter.commit(10, 15.0)  # 0.5 s per step
    assert meter.read(20.0).kept_seconds == pytest.approx(5.0)
    meter.ranks([rank("a.0", None, rolled_back=4), rank("b.0", None, rolled_back=4)])
    assert meter.read(20.0).rollback_seconds == pytest.approx(2.0)
    meter.commit(20, 40.0)  # a rollback between: the old pace counts, not 2.5 s per step
    assert meter.read(40.0).kept_seconds == pytest.approx(10.0)
    assert meter.read(40.0).ratio == pytest.approx(0.25)
