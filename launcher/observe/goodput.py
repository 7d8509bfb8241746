"""Goodput: the share of the job's wall time spent in training steps that were kept.

Google's measure, applied to an elastic ring: a step counts once it is committed (a failure rolls
the ring back to the last commit, so steps after it are run again); each kept step counts the
time a step took when it was committed (the median of the ranks' last step times; for a
script that reports only its commits, the wall time per step between its last two commits
with no failure between them). Steps run
after the last commit and lost to a failure are *time lost to rollbacks*: each process counts
the steps it rolled back (``ea.State.restore``) and reports the total with its progress; the
survivors of one failure all roll back the same steps, so the ring lost the largest increase
among them. Everything else (start-up, re-forms, syncs, evaluation, the steps lost) is the rest
of the wall time.

:class:`GoodputMeter` is pure: the observer feeds it the ranks' reports and the commits, with
the time, and reads :class:`Goodput`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from elastic_allreduce.records.values import RankProgress


@dataclass(frozen=True)
class Goodput:
    """The figures at one moment."""

    #: Kept step time / wall time since the job started (None before any wall time passed).
    ratio: float | None
    kept_seconds: float
    wall_seconds: float
    #: Steps run after a commit and lost to a failure, and the time they took.
    rollback_steps: int
    rollback_seconds: float
    #: Samples per second of the last measured step (global batch / step time), when known.
    samples_per_second: float | None


class GoodputMeter:
    """Counts kept and rolled-back step time (see the module docstring)."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.kept_seconds = 0.0
        self.rollback_steps = 0
        self.rollback_seconds = 0.0
        self._step_seconds: float | None = None
        self._samples_per_step: int | None = None
        #: The step of the last commit and when it was seen (None: none seen yet).
        self._committed: int | None = None
        self._committed_at = 0.0
        #: Seconds per step between the last two commits with no rollback between them.
        self._commit_pace: float | None = None
        self._rolled_back_since_commit = False
        #: Each process's rolled-back steps as last reported, by (slot, incarnation).
        self._rolled_back: dict[tuple[str, int], int] = {}

    def ranks(self, reports: Iterable[RankProgress]) -> None:
        """The ring members' last reports: step times, global batches, rolled-back steps."""
        reports = list(reports)
        times = [r.step_seconds for r in reports if r.step_seconds]
        if times:
            self._step_seconds = statistics.median(times)
        batches = [r.samples_per_step for r in reports if r.samples_per_step]
        if batches:
            self._samples_per_step = max(batches)
        lost = 0
        for report in reports:
            process = (report.slot, report.incarnation)
            before = self._rolled_back.get(process, 0)
            if report.rolled_back_steps > before:
                lost = max(lost, report.rolled_back_steps - before)
                self._rolled_back[process] = report.rolled_back_steps
        if lost:
            self.rollback_steps += lost
            self.rollback_seconds += lost * (self._seconds_per_step() or 0.0)
            self._rolled_back_since_commit = True

    def _seconds_per_step(self) -> float | None:
        return self._step_seconds or self._commit_pace

    def commit(self, step: int, at: float) -> None:
        """Rank 0 committed ``step`` (seen at ``at``): the steps since the previous commit are
        kept. The first commit seen is the baseline (a job resumed from a checkpoint starts
        past 0)."""
        if self._committed is not None and step <= self._committed:
            return
        if self._committed is not None:
            steps = step - self._committed
            if not self._rolled_back_since_commit and at > self._committed_at:
                self._commit_pace = (at - self._committed_at) / steps
            seconds = self._seconds_per_step()
            if seconds:
                self.kept_seconds += steps * seconds
        self._committed, self._committed_at = step, at
        self._rolled_back_since_commit = False

    def read(self, now: float) -> Goodput:
        """The figures at ``now`` (the same clock as ``started_at``)."""
        wall = max(0.0, now - self.started_at)
        ratio = min(1.0, self.kept_seconds / wall) if wall > 0 else None
        rate = None
        seconds = self._seconds_per_step()
        if self._samples_per_step and seconds:
            rate = self._samples_per_step / seconds
        return Goodput(
            ratio, self.kept_seconds, wall, self.rollback_steps, self.rollback_seconds, rate
        )
