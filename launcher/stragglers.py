"""Which rank of the ring is a straggler: pure, stepped by the launcher (no I/O).

A synchronous ring steps at the pace of its slowest rank; the others wait for it in the
gradient allreduce. Each rank reports the seconds its last step took and how long its last
allreduce waited (``ProgressReport.step_seconds`` and ``collective_seconds``, about once a
second: ``elastic_allreduce.collective_clock``); their difference is the rank's own share of the
step (its compute, its input pipeline), measured on its own clock. A rank whose share stays
above ``factor`` times the median share of the other ranks, over a window of ``window``
reports of its own, is a straggler. It is announced once, and again only after it recovered
(its share back under ``factor`` times the median) and fell behind anew. A uniformly slow ring
has no straggler: every share is slow alike. Rings where a rank reports no wait (Keras ``fit``,
scripts that allreduce by themselves) are not judged.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from elastic_allreduce.rendezvous.protocol import ProgressReport

#: The default ``--straggler-factor``.
DEFAULT_FACTOR: Final = 2.0
#: Reports of each rank that make a window (about one a second).
DEFAULT_WINDOW: Final = 10


@dataclass(frozen=True)
class Straggler:
    """``slot``'s own share of a step (median over the window) against the other ranks'."""

    slot: str
    share: float
    others: float

    @property
    def factor(self) -> float:
        return self.share / self.others if self.others > 0 else float("inf")

    def faster_without(self, size: int) -> bool:
        """Whether a ring of ``size`` ranks would step faster without this one: with a fixed
        global batch the others' shares grow by ``size / (size - 1)``, and the step takes the
        slowest share (so also for a per-rank batch: fewer samples per step, but in a shorter
        step by more than that)."""
        return size >= 2 and self.factor > size / (size - 1)

    def describe(self) -> str:
        return (
            f"slot {self.slot} is a straggler: its share of each step is {self.share:.3f} s, "
            f"{self.factor:.1f}x the other ranks' {self.others:.3f} s (the ring waits for it "
            "at every allreduce)"
        )


class StragglerWatch:
    """Keeps each ring member's recent shares and names the ranks that lag (module docstring)."""

    def __init__(self, factor: float = DEFAULT_FACTOR, window: int = DEFAULT_WINDOW) -> None:
        self.factor = factor
        self.window = window
        #: Per (slot, incarnation): the last report's tick count, and the recent shares.
        self._ticks: dict[tuple[str, int], int] = {}
        self._shares: dict[tuple[str, int], deque[float]] = {}
        self._announced: set[tuple[str, int]] = set()

    def step(
        self, members: Sequence[str], reports: Mapping[str, ProgressReport]
    ) -> list[Straggler]:
        """Take in the members' latest reports; the stragglers found now (not yet announced)."""
        keys = []
        for slot in members:
            report = reports.get(slot)
            if report is None:
                return []
            key = (slot, report.incarnation)
            keys.append(key)
            if self._ticks.get(key) == report.ticks:
                continue  # the same report again: no new step
            self._ticks[key] = report.ticks
            if report.step_seconds is None or report.collective_seconds is None:
                continue
            share = max(0.0, report.step_seconds - report.collective_seconds)
            self._shares.setdefault(key, deque(maxlen=self.window)).append(share)
        self._forget(set(keys))
        if len(keys) < 2 or any(len(self._shares.get(key, ())) < self.window for key in keys):
            return []
        medians = {key: statistics.median(self._shares[key]) for key in keys}
        found = []
        for key in keys:
            others = statistics.median(m for k, m in medians.items() if k != key)
            lagging = medians[key] > self.factor * others
            if lagging and key not in self._announced:
                self._announced.add(key)
                found.append(Straggler(key[0], medians[key], others))
            elif not lagging:
                self._announced.discard(key)
        return found

    def _forget(self, current: set[tuple[str, int]]) -> None:
        """Drop what was kept about processes no longer in the ring."""
        for table in (self._ticks, self._shares):
            for key in [k for k in table if k not in current]:
                del table[key]
        self._announced &= current
