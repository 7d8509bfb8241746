"""The seeded schedule of faults (:class:`Plan`: every random choice drawn up front, so a seed
replays the same soak) and the record of what each fault did (:class:`Fault`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.soak.settings import KINDS

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """One fault of the schedule; every random choice is drawn from the seed up front."""

    index: int
    kind: str
    pick: float  #: chooses the victim among the candidates (sorted by name) at fault time
    hold_s: float  #: a stall's, a member's downtime's, an outage's or a cut's length
    flag: bool  #: stop: a stall (else a hang); member_kill: the leader
    gap_s: float  #: training time after the previous fault's recovery, at least


def schedule(seed: int, count: int) -> list[Plan]:
    """``count`` faults: every kind equally often (the remainder drawn), shuffled."""
    rng = random.Random(seed)
    kinds = list(KINDS) * (count // len(KINDS)) + rng.sample(KINDS, count % len(KINDS))
    rng.shuffle(kinds)
    plans = []
    for index, kind in enumerate(kinds, 1):
        flag = rng.random() < 0.5
        holds = {
            "stop": (0.2, 0.35),
            "adopt": (4.0, 5.5),  # past the lease TTL: before, `run` refuses (a live leader)
            "member_kill": (2.0, 6.0),
            "quorum_loss": (18.0, 22.0),
            "partition": (5.0, 8.0),
        }
        hold = rng.uniform(*holds[kind]) if kind in holds else 0.0
        plans.append(Plan(index, kind, rng.random(), hold, flag, rng.uniform(0.5, 2.0)))
    return plans


def chosen(items: Sequence[T], pick: float) -> T:
    """The item that ``pick`` (in [0, 1)) falls on."""
    return items[min(int(pick * len(items)), len(items) - 1)]


@dataclass
class Fault:
    """What one fault did and when the job stepped again."""

    index: int
    kind: str
    at_s: float  #: since the soak job started
    target: str
    ranks_before: int
    recovery_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    waited_s: float = 0.0  #: since the previous fault was over: training, health, upkeep
