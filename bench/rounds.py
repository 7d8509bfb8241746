"""A/B rounds for the overhead items (8, progress reporting; 10, observability): the same
measurement with a feature on (A) and off (B), alternating, and the figures both report from
them. Within a round the order alternates (A B, then B A, ...), so a load that drifts during
the run does not always favour the same side."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

from bench.items.throughput import twice
from bench.jobs import log, summarize

#: One measured round of one side: :func:`bench.jobs.step_rate`'s figures (and any more).
Round = dict[str, float]


def alternate(
    rounds: int, measure: Callable[[bool], Round], *, what: str, on: str, off: str
) -> tuple[list[Round], list[Round]]:
    """``measure(True)`` (A) and ``measure(False)`` (B) once per round each, the order swapped
    every round, each measured again once if its job failed; A's rounds and B's. Logs each
    round as ``{what} round N: {on} ..., {off} ...``."""
    a: list[Round] = []
    b: list[Round] = []
    for round_ in range(rounds):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        for feature in order:
            measured = twice(functools.partial(measure, feature))
            (a if feature else b).append(measured)
        log(f"{what} round {round_}: {on} {a[-1]}, {off} {b[-1]}")
    return a, b


def rates(rounds: list[Round]) -> list[float]:
    """Rank 0's steps/s of each round."""
    return [r["steps_per_s"] for r in rounds]


def _spread(values: list[float]) -> float:
    """(max - min) / median of the rounds of one side; 0 with a single round."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def _per_cpu(rounds: list[Round]) -> float | None:
    """Median over rounds of steps/s per core the training processes used (the feature's
    share of them included)."""
    ratios = [r["steps_per_s"] / r["workers_cpu"] for r in rounds if r["workers_cpu"] > 0]
    return statistics.median(ratios) if ratios else None


def ab_figures(on: list[Round], off: list[Round]) -> dict[str, Any]:
    """What A costs against B: the ratio of medians and of each round's pair, the overhead
    (1 - A/B, %), the rounds' own noise, steps per CPU-second and the CPU of each side."""
    a, b = rates(on), rates(off)
    ratio = statistics.median(a) / statistics.median(b)
    per_cpu_on, per_cpu_off = _per_cpu(on), _per_cpu(off)
    return {
        # A / B of medians, and of each round's pair.
        "ratio": ratio,
        "round_ratios": [x / y for x, y in zip(a, b, strict=True)],
        "overhead_pct": (1.0 - ratio) * 100.0,
        "round_overheads_pct": [(1.0 - x / y) * 100.0 for x, y in zip(a, b, strict=True)],
        # The rounds' own noise: the larger relative spread (max - min) / median of one side.
        "noise_pct": max(_spread(a), _spread(b)) * 100.0,
        # Steps per CPU-second of the training processes: less sensitive to what else the
        # machine runs than steps/s.
        "steps_per_cpu_s": {"on": per_cpu_on, "off": per_cpu_off},
        "per_cpu_overhead_pct": (
            (1.0 - per_cpu_on / per_cpu_off) * 100.0 if per_cpu_on and per_cpu_off else None
        ),
        # CPU in cores during the measured windows: the training processes, and the rest
        # (launcher, agents, etcd).
        "cpu": {
            "on_workers": summarize([r["workers_cpu"] for r in on]),
            "on_others": summarize([r["others_cpu"] for r in on]),
            "off_workers": summarize([r["workers_cpu"] for r in off]),
            "off_others": summarize([r["others_cpu"] for r in off]),
        },
    }
