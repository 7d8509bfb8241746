"""The hang watchdog: a ring that makes no progress is diagnosed and recovered, never left hanging.

Training processes report their progress to the launcher's rendezvous server about once a
second (:mod:`elastic_allreduce.progress`); :class:`ProgressBoard` keeps the last report of each
slot (HTTP handler threads write it, the control loop reads it). :class:`HangWatchdog` is pure,
like :class:`~launcher.leader.policy.RingPolicy`: each :meth:`HangWatchdog.step` looks at the
running ring, the reports and the stacks received, and returns decisions the launcher executes.

The rule: when no member of the running ring epoch (while a resize epoch forms: of the last
running one, whose members train until their next commit) has made progress (a step or a commit) for
``--hang-timeout`` seconds, while none of them is in a marked phase (startup until its first
step, a sync, an evaluation, a checkpoint write), the watchdog asks every member for its
stacks. A marked phase holds the clock only while the members in one share it: ranks sitting
in different phases -- some in the state sync, one still in its start-up, running collectives
of its own -- cannot all be waiting for each other's long work, so that counts as no progress
too (a newcomer admitted before its script ran, whose warm-up allreduce met the survivors'
sync, hung that way for ever). Then it asks every member for its
stacks, waits up to :data:`STACKS_WAIT` seconds for them, and finds the odd ones out: the ranks
that are not waiting in a collective (or did not answer). Those are replaced -- the others then
fail their collective, roll back to the last commit and re-form with the replacement. When
every rank waits in a collective of ranks in different phases, the odd ones out are those not
in rank 0's phase; when every rank waits in a collective of one phase (mismatched collectives,
a hung NCCL), all but rank 0, which holds the committed state, are replaced. A second hang at
the same place (the same frames of the odd ones out) fails the job with the diagnosis as its
reason.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeAlias

from elastic_allreduce.records.values import (
    EpochCause,
    HangRank,
    HangRecord,
    RankProgress,
    RanksRecord,
    Ring,
    RingState,
)
from elastic_allreduce.rendezvous.protocol import ProgressReply, ProgressReport, StacksReport
from launcher.vocabulary import Log

#: Seconds the watchdog waits for the members' stacks once it asked for them (reports come
#: about once a second).
STACKS_WAIT: Final = 4.0


@dataclass(frozen=True)
class SeenProgress:
    """A slot's last progress report, with when its count last changed (launcher's clocks)."""

    report: ProgressReport
    #: Monotonic time its ``ticks`` last changed (or it first reported).
    changed_at: float
    #: The same moment as Unix time, for ``status/ranks``.
    changed_wall: float


class ProgressBoard:
    """The last progress report and the requested stacks of each slot. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, SeenProgress] = {}
        self._wanted: set[str] = set()
        self._stacks: dict[str, StacksReport] = {}

    def receive(self, slot: str, report: ProgressReport, now: float, wall: float) -> ProgressReply:
        """Record a report (``PUT /progress/<slot>``); the reply asks for stacks if wanted."""
        with self._lock:
            before = self._seen.get(slot)
            same = (
                before is not None
                and before.report.incarnation == report.incarnation
                and before.report.ticks == report.ticks
            )
            if same and before is not None:
                self._seen[slot] = SeenProgress(report, before.changed_at, before.changed_wall)
            else:
                self._seen[slot] = SeenProgress(report, now, wall)
            return ProgressReply(send_stacks=slot in self._wanted)

    def receive_stacks(self, slot: str, stacks: StacksReport) -> bool:
        """Record stacks (``PUT /stacks/<slot>``); False when they were not asked for."""
        with self._lock:
            if slot not in self._wanted:
                return False
            self._wanted.discard(slot)
            self._stacks[slot] = stacks
            return True

    def request_stacks(self, slots: tuple[str, ...]) -> None:
        """Ask these slots for their stacks (with their next report)."""
        with self._lock:
            self._wanted = set(slots)
            self._stacks = {}

    def seen(self) -> dict[str, SeenProgress]:
        with self._lock:
            return dict(self._seen)

    def stacks(self) -> dict[str, StacksReport]:
        with self._lock:
            return dict(self._stacks)


@dataclass(frozen=True)
class RingLook:
    """What the watchdog looks at: the ring, its members' incarnations, and what the members
    reported (progress and, once asked, stacks). ``now`` is monotonic, ``wall`` Unix time."""

    now: float
    wall: float
    ring: Ring | None
    incarnations: Mapping[str, int]
    seen: Mapping[str, SeenProgress]
    stacks: Mapping[str, StacksReport]


@dataclass(frozen=True)
class RequestStacks:
    """Ask these members for their stacks."""

    slots: tuple[str, ...]


@dataclass(frozen=True)
class HangFound:
    """The ring hung: record the diagnosis, then replace ``replace`` or fail the job."""

    record: HangRecord
    replace: tuple[str, ...]
    fail: bool


WatchdogDecision: TypeAlias = Log | RequestStacks | HangFound


class HangWatchdog:
    """The watchdog's state machine (see the module docstring); ``timeout`` 0 turns it off."""

    def __init__(self, timeout: float, stacks_wait: float = STACKS_WAIT) -> None:
        self.timeout = timeout
        self.stacks_wait = stacks_wait
        self._epoch: int | None = None
        self._running: Ring | None = None
        self._clock_start = 0.0
        self._asked_at: float | None = None
        #: Where the odd ones out were at each hang so far.
        self._places: set[tuple[str, ...]] = set()

    def step(self, look: RingLook) -> list[WatchdogDecision]:
        """The decisions for this look at the ring."""
        now, incarnations = look.now, look.incarnations
        ring = self._watched(look.ring)
        if self.timeout <= 0 or ring is None:
            self._epoch, self._asked_at = None, None
            return []
        if ring.epoch != self._epoch:
            self._epoch, self._clock_start, self._asked_at = ring.epoch, now, None
        current = _current(ring, incarnations, look.seen)
        quiet_since = self._quiet_since(now, ring, current)
        if self._asked_at is None:
            if now - quiet_since < self.timeout:
                return []
            self._asked_at = now
            phases = _phases(current)
            apart = (
                " while its ranks sit in different phases ("
                + ", ".join(
                    f"{slot} {seen.report.phase or 'training'}" for slot, seen in current.items()
                )
                + ")"
                if len(phases) > 1
                else ""
            )
            return [
                Log(
                    f"epoch {ring.epoch}: no progress for {now - quiet_since:.1f} s{apart} "
                    f"(--hang-timeout {self.timeout:g}); collecting every rank's stacks"
                ),
                RequestStacks(ring.slots),
            ]
        if quiet_since > self._asked_at:
            self._asked_at = None
            return [Log(f"epoch {ring.epoch}: progress resumed; no hang")]
        answers = {
            slot: report
            for slot, report in look.stacks.items()
            if slot in ring.slots and report.incarnation == incarnations.get(slot)
        }
        if len(answers) < len(ring.slots) and now - self._asked_at < self.stacks_wait:
            return []
        self._asked_at = None
        # The ring re-forms after a replacement; until then, no second diagnosis.
        self._clock_start = now
        stalled_for = now - quiet_since
        return [self._diagnose(look, ring, stalled_for, current=current, answers=answers)]

    def _watched(self, ring: Ring | None) -> Ring | None:
        """The ring whose members train now: the running epoch or, while a resize epoch forms,
        the last running one (its members train on until their next commit). None while a
        failed epoch re-forms (the stuck-member timeout watches that)."""
        if ring is not None and ring.state is RingState.RUNNING:
            self._running = ring
        elif ring is None or ring.cause is not EpochCause.RESIZE:
            self._running = None
        return self._running

    def _quiet_since(self, now: float, ring: Ring, current: Mapping[str, SeenProgress]) -> float:
        """Since when the ring made no progress; ``now`` while the clock is held: members in
        one marked phase (those in none wait for them), or one that has not reported from this
        incarnation yet. Members in different marked phases hold nothing."""
        if len(current) < len(ring.slots) or len(_phases(current)) == 1:
            self._clock_start = now
            return now
        return max(self._clock_start, *(seen.changed_at for seen in current.values()))

    def _diagnose(
        self,
        look: RingLook,
        ring: Ring,
        stalled_for: float,
        *,
        current: Mapping[str, SeenProgress],
        answers: Mapping[str, StacksReport],
    ) -> HangFound:
        ranks = []
        for rank, slot in enumerate(ring.slots):
            seen = current.get(slot)
            step = seen.report.step if seen is not None else None
            answer = answers.get(slot)
            if answer is None:
                ranks.append(HangRank(slot, rank, step, None, "unknown", "", answered=False))
            else:
                ranks.append(
                    HangRank(slot, rank, step, answer.collective, answer.where, answer.stacks, True)
                )
        odd = tuple(r.slot for r in ranks if not r.answered or r.collective is None)
        if not odd and len(_phases(current)) > 1:
            # Collectives of different phases: those apart from rank 0's (which holds the
            # committed state) are the odd ones out.
            first = current[ring.slots[0]].report.phase if ring.slots[0] in current else None
            odd = tuple(s for s in ring.slots if s in current and current[s].report.phase != first)
        if not odd:
            odd = ring.slots[1:] or ring.slots
        place = tuple(sorted(r.where for r in ranks if r.slot in odd))
        fail = place in self._places
        self._places.add(place)
        where = ", ".join(sorted(set(place)))
        if fail:
            action = f"failing the job: it hung at the same place before ({where})"
        else:
            action = f"replacing {', '.join(f'slot {slot}' for slot in odd)} (at {where})"
        record = HangRecord(ring.epoch, look.wall, round(stalled_for, 1), action, tuple(ranks))
        return HangFound(record, () if fail else odd, fail)


def _phases(current: Mapping[str, SeenProgress]) -> set[str]:
    """The marked phases the members are in (none: all of them train)."""
    return {seen.report.phase for seen in current.values() if seen.report.phase is not None}


def _current(
    ring: Ring, incarnations: Mapping[str, int], seen: Mapping[str, SeenProgress]
) -> dict[str, SeenProgress]:
    """The reports of the ring's members from the incarnation that is the member."""
    return {
        slot: seen[slot]
        for slot in ring.slots
        if slot in seen and seen[slot].report.incarnation == incarnations.get(slot)
    }


def ranks_record(
    ring: Ring, incarnations: Mapping[str, int], seen: Mapping[str, SeenProgress], wall: float
) -> RanksRecord:
    """``status/ranks`` for the ring's members (a member that has not reported: no step)."""
    ranks = []
    for rank, slot in enumerate(ring.slots):
        progress = _current(ring, incarnations, seen).get(slot)
        incarnation = incarnations.get(slot, 1)
        if progress is None:
            ranks.append(RankProgress(slot, rank, incarnation, None, 0, None, "startup", None))
            continue
        report = progress.report
        ranks.append(
            RankProgress(
                slot,
                rank,
                report.incarnation,
                report.step,
                report.ticks,
                None if report.step_seconds is None else round(report.step_seconds, 4),
                report.phase,
                round(progress.changed_wall, 3) if report.ticks else None,
                report.total_steps,
                report.samples_per_step,
                report.rolled_back_steps,
            )
        )
    return RanksRecord(ring.epoch, round(wall, 3), tuple(ranks))
