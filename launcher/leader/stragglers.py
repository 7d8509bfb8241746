"""Which rank of the ring is a straggler: pure, stepped by the launcher (no I/O).

A synchronous ring steps at the pace of its slowest rank; the others wait for it in the
gradient allreduce. Each rank reports the seconds its last step took and how long its last
allreduce waited (``ProgressReport.step_seconds`` and ``collective_seconds``, about once a
second: ``elastic_allreduce.training.collective_clock``); their difference is the rank's own share
of the
step (its compute, its input pipeline), measured on its own clock. A rank whose share stays
above ``factor`` times the median share of the other ranks, over a window of ``window``
reports of its own, is a straggler. It is announced once, and again only after it recovered
(its share back under ``factor`` times the median) and fell behind anew. A uniformly slow ring
has no straggler: every share is slow alike. Rings where a rank reports no wait (scripts that
allreduce by themselves) are not judged. A warm joiner's step at a ring of one, timed after its
trace (``--warm-join``), is compared with the ring's share the same way when it asks to join
(:meth:`StragglerWatch.newcomer`): a slow one is reported before it slows the ring.
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


def times(share: float, base: float) -> float:
    """How many times ``base`` a ``share`` of a step is (infinite over a base of 0)."""
    return share / base if base > 0 else float("inf")


@dataclass(frozen=True)
class Straggler:
    """``slot``'s own share of a step (median over the window) against the other ranks'."""

    slot: str
    share: float
    others: float

    @property
    def factor(self) -> float:
        return times(self.share, self.others)

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


@dataclass(frozen=True)
class Newcomer:
    """A warm joiner's step at a ring of one (``warmup``, seconds) against the ring's share."""

    slot: str
    warmup: float
    ring: float
    factor_limit: float

    @property
    def factor(self) -> float:
        return times(self.warmup, self.ring)

    @property
    def slow(self) -> bool:
        """Whether it would be a straggler: its step above the limit times the ring's share."""
        return self.factor > self.factor_limit

    def describe(self) -> str:
        verdict = (
            "slow: it would hold the ring back (it joins; the watch judges it again once it trains)"
            if self.slow
            else "not slow"
        )
        return (
            f"slot {self.slot} warmed up: one step {self.warmup:.3f} s at a ring of one, "
            f"{self.factor:.1f}x the ring's share of a step ({self.ring:.3f} s): {verdict}"
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
        #: The newest median share of a step of each ring member with a full window.
        self._medians: dict[tuple[str, int], float] = {}
        self._newcomers: set[tuple[str, int]] = set()

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
        self._medians = medians
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

    def newcomer(self, slot: str, incarnation: int, warmup: float) -> Newcomer | None:
        """A warm joiner's warm-up step against the ring's share of a step (the median of the
        members' medians), once per process; None while the ring has no full window yet, or
        once judged."""
        key = (slot, incarnation)
        if key in self._newcomers or not self._medians:
            return None
        self._newcomers.add(key)
        ring = statistics.median(self._medians.values())
        return Newcomer(slot, warmup, ring, self.factor)

    def _forget(self, current: set[tuple[str, int]]) -> None:
        """Drop what was kept about processes no longer in the ring."""
        for table in (self._ticks, self._shares, self._medians):
            for key in [k for k in table if k not in current]:
                del table[key]
        self._announced &= current
