"""The hang watchdog, step by step (pure: launcher.leader.watchdog), and the progress board."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from elastic_allreduce.records.values import EpochCause, Ring, RingState
from elastic_allreduce.rendezvous.protocol import ProgressReport, StacksReport
from launcher.leader.watchdog import (
    HangFound,
    HangWatchdog,
    ProgressBoard,
    RequestStacks,
    RingLook,
    SeenProgress,
    ranks_record,
)
from launcher.vocabulary import Log

SLOTS = ("n0.0", "n1.0", "n2.0")
RING = Ring(2, SLOTS, RingState.RUNNING, "h:1")
INCARNATIONS = dict.fromkeys(SLOTS, 1)
TIMEOUT = 30.0


class Ranks:
    """What the members reported, as a board would hold it."""

    def __init__(self) -> None:
        self.board = ProgressBoard()
        self.now = 100.0

    def report(self, slot: str, ticks: int, phase: str | None = None, step: int = 0) -> None:
        self.board.receive(slot, ProgressReport(1, ticks, step, phase), self.now, 1e9 + self.now)

    def all_step(self, ticks: int) -> None:
        for slot in SLOTS:
            self.report(slot, ticks, step=ticks)

    def look(self, ring: Ring | None = RING, stacks: Mapping[str, StacksReport] = {}) -> RingLook:
        return RingLook(self.now, 1e9 + self.now, ring, INCARNATIONS, self.board.seen(), stacks)


def in_collective(where: str = "train.py:30 in train") -> StacksReport:
    return StacksReport(
        1, "a compiled TensorFlow function (execute.py:53 in quick_execute)", where, ""
    )


def sleeping() -> StacksReport:
    return StacksReport(1, None, "train.py:44 in hang_here", 'Thread "MainThread":\n  time.sleep')


def hang_until_asked(watchdog: HangWatchdog, ranks: Ranks) -> list[object]:
    """Steps at 10 then nothing for the timeout: the watchdog asks for stacks."""
    ranks.all_step(10)
    assert watchdog.step(ranks.look()) == []
    ranks.now += TIMEOUT - 1
    assert watchdog.step(ranks.look()) == []
    ranks.now += 1.5
    return list(watchdog.step(ranks.look()))


def test_a_ring_that_steps_is_never_a_hang() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    for ticks in range(1, 200):
        ranks.all_step(ticks)
        assert watchdog.step(ranks.look()) == []
        ranks.now += 1.0  # 200 s in all, far above the timeout, with progress each second


def test_no_progress_for_the_timeout_asks_every_member_for_its_stacks() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    decisions = hang_until_asked(watchdog, ranks)
    assert isinstance(decisions[0], Log) and "no progress for 30.5 s" in decisions[0].message
    assert decisions[1] == RequestStacks(SLOTS)


def test_the_rank_outside_a_collective_is_replaced_once_every_rank_answered() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    hang_until_asked(watchdog, ranks)
    ranks.now += 1.0
    partial = {"n0.0": in_collective(), "n1.0": sleeping()}
    assert watchdog.step(ranks.look(stacks=partial)) == []  # n2.0 may still answer
    answers = {**partial, "n2.0": in_collective()}
    [found] = watchdog.step(ranks.look(stacks=answers))
    assert isinstance(found, HangFound)
    assert found.replace == ("n1.0",) and not found.fail
    record = found.record
    assert record.epoch == 2 and record.stalled_for == pytest.approx(31.5)
    assert [r.collective is None for r in record.ranks] == [False, True, False]
    assert "rank 1 (slot n1.0, step 10): NOT in a collective, at train.py:44 in hang_here" in (
        record.describe()
    )
    assert "replacing slot n1.0" in record.action


def test_a_rank_that_does_not_answer_is_an_odd_one_out_after_the_wait() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT, stacks_wait=4.0), Ranks()
    hang_until_asked(watchdog, ranks)
    answers = {"n0.0": in_collective(), "n1.0": in_collective()}
    ranks.now += 3.9
    assert watchdog.step(ranks.look(stacks=answers)) == []
    ranks.now += 0.2
    [found] = watchdog.step(ranks.look(stacks=answers))
    assert isinstance(found, HangFound) and found.replace == ("n2.0",)
    assert "did not answer" in found.record.describe()


def test_when_every_rank_waits_in_a_collective_all_but_rank_0_are_replaced() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    hang_until_asked(watchdog, ranks)
    [found] = watchdog.step(ranks.look(stacks=dict.fromkeys(SLOTS, in_collective())))
    assert isinstance(found, HangFound) and found.replace == ("n1.0", "n2.0")


def test_a_second_hang_at_the_same_place_fails_the_job() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    hang_until_asked(watchdog, ranks)
    answers = {"n0.0": in_collective(), "n1.0": sleeping(), "n2.0": in_collective()}
    [first] = watchdog.step(ranks.look(stacks=answers))
    assert isinstance(first, HangFound) and not first.fail
    # The ring re-forms (epoch 3) with a replacement; another rank sleeps at the same line.
    ring = Ring(3, ("n0.0", "n2.0", "n1.0"), RingState.RUNNING, "h:1")
    ranks.now += 5
    ranks.all_step(11)
    assert watchdog.step(ranks.look(ring)) == []
    ranks.now += TIMEOUT + 0.5
    assert any(isinstance(d, RequestStacks) for d in watchdog.step(ranks.look(ring)))
    answers = {"n0.0": in_collective(), "n2.0": sleeping(), "n1.0": in_collective()}
    [second] = watchdog.step(ranks.look(ring, answers))
    assert isinstance(second, HangFound) and second.fail and second.replace == ()
    assert "hung at the same place before (train.py:44 in hang_here)" in second.record.action


def test_a_hang_elsewhere_is_replaced_again() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    hang_until_asked(watchdog, ranks)
    answers = {"n0.0": in_collective(), "n1.0": sleeping(), "n2.0": in_collective()}
    watchdog.step(ranks.look(stacks=answers))
    ranks.now += TIMEOUT + 0.5
    assert any(isinstance(d, RequestStacks) for d in watchdog.step(ranks.look()))
    other = StacksReport(1, None, "data.py:12 in read_shard", "")
    [found] = watchdog.step(ranks.look(stacks={**answers, "n1.0": other}))
    assert isinstance(found, HangFound) and not found.fail


@pytest.mark.parametrize("phase", ["startup", "evaluation", "checkpoint", "sync"])
def test_a_rank_in_a_marked_phase_holds_the_clock(phase: str) -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    ranks.all_step(10)
    watchdog.step(ranks.look())
    ranks.report("n2.0", 10, phase=phase)
    for _ in range(10):  # 100 s in a long evaluation on one rank, the others waiting
        ranks.now += 10
        ranks.report("n2.0", 10, phase=phase)
        assert watchdog.step(ranks.look()) == []
    ranks.report("n2.0", 10)  # the phase ended, and nothing moves any more
    ranks.now += TIMEOUT - 1
    assert watchdog.step(ranks.look()) == []
    ranks.now += 1.5
    assert any(isinstance(d, RequestStacks) for d in watchdog.step(ranks.look()))


def test_every_rank_in_one_phase_holds_the_clock() -> None:
    """The first ring: every rank in its start-up (one builds a big model, the others wait
    for it in their first sync -- also 'startup' until their first step)."""
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    for _ in range(10):
        for slot in SLOTS:
            ranks.report(slot, 0, phase="startup")
        assert watchdog.step(ranks.look()) == []
        ranks.now += 10


def test_ranks_in_different_phases_hang_after_the_timeout_and_are_diagnosed() -> None:
    """Issue #39, item 4: survivors in the state sync and a newcomer still in its start-up
    (admitted before its script ran, its warm-up allreduce meeting their broadcast) used to
    hold the clock for ever. Each rank waits in a collective: the one apart from rank 0's
    phase, the newcomer, is replaced."""
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    ranks.all_step(10)
    watchdog.step(ranks.look())
    for slot in ("n0.0", "n1.0"):
        ranks.report(slot, 10, phase="sync")
    ranks.report("n2.0", 0, phase="startup")
    ranks.now += TIMEOUT - 1
    assert watchdog.step(ranks.look()) == []
    ranks.now += 1.5
    decisions = watchdog.step(ranks.look())
    assert isinstance(decisions[0], Log), decisions
    assert (
        "while its ranks sit in different phases (n0.0 sync, n1.0 sync, n2.0 startup)"
        in decisions[0].message
    )
    assert decisions[1] == RequestStacks(SLOTS)
    sync = StacksReport(1, "Horovod broadcast (functions.py:60 in broadcast_variables)", "", "")
    answers = {
        "n0.0": sync,
        "n1.0": sync,
        "n2.0": in_collective("train.py:71 in <module>"),
    }
    [found] = watchdog.step(ranks.look(stacks=answers))
    assert isinstance(found, HangFound) and found.replace == ("n2.0",)
    by_slot = {rank.slot: rank for rank in found.record.ranks}
    assert by_slot["n2.0"].where == "train.py:71 in <module>"
    assert by_slot["n0.0"].collective is not None and by_slot["n0.0"].collective.startswith(
        "Horovod broadcast"
    )


def test_a_rank_in_a_phase_beside_ranks_that_train_holds_the_clock() -> None:
    """One rank checkpoints, the others wait for it in their next allreduce (no phase)."""
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    ranks.all_step(10)
    watchdog.step(ranks.look())
    for _ in range(10):
        ranks.now += 10
        ranks.report("n0.0", 10, phase="checkpoint")
        assert watchdog.step(ranks.look()) == []


def test_progress_while_collecting_stacks_calls_it_off() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    hang_until_asked(watchdog, ranks)
    ranks.now += 0.5
    ranks.report("n1.0", 11)
    [log] = watchdog.step(ranks.look())
    assert isinstance(log, Log) and "progress resumed" in log.message


def test_a_member_that_never_reported_from_its_incarnation_holds_the_clock() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    ranks.report("n0.0", 5)
    ranks.report("n1.0", 5)
    ranks.board.receive("n2.0", ProgressReport(7, 5), ranks.now, 0.0)  # an older incarnation
    for _ in range(10):
        ranks.now += 10
        assert watchdog.step(ranks.look()) == []


def test_while_a_resize_forms_the_members_of_the_running_epoch_are_watched() -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    ranks.all_step(10)
    assert watchdog.step(ranks.look()) == []
    # A joiner (n3.0, still starting) makes a resize epoch; the members train to their commit.
    resize = Ring(3, (*SLOTS, "n3.0"), RingState.FORMING, "h:1", ("n3.0",), EpochCause.RESIZE)
    ranks.report("n3.0", 0, phase="startup")
    ranks.now += 5
    assert watchdog.step(ranks.look(resize)) == []
    ranks.now += TIMEOUT
    decisions = watchdog.step(ranks.look(resize))
    assert RequestStacks(SLOTS) in decisions, decisions
    assert isinstance(decisions[0], Log) and decisions[0].message.startswith("epoch 2:")


@pytest.mark.parametrize(
    "ring",
    [None, Ring(2, SLOTS, RingState.FORMING, "h:1", cause=EpochCause.FAILURE)],
    ids=["no ring", "re-forming after a failure"],
)
def test_only_a_running_ring_is_watched(ring: Ring | None) -> None:
    watchdog, ranks = HangWatchdog(TIMEOUT), Ranks()
    ranks.all_step(1)
    for _ in range(10):
        ranks.now += 10
        assert watchdog.step(ranks.look(ring)) == []


def test_timeout_zero_turns_the_watchdog_off() -> None:
    watchdog, ranks = HangWatchdog(0), Ranks()
    ranks.all_step(1)
    ranks.now += 10_000
    assert watchdog.step(ranks.look()) == []


def test_the_board_asks_for_stacks_once_and_keeps_only_asked_ones() -> None:
    board = ProgressBoard()
    report = ProgressReport(1, 3, 3)
    assert not board.receive("n0.0", report, 1.0, 1.0).send_stacks
    assert not board.receive_stacks("n0.0", sleeping())  # not asked: dropped
    board.request_stacks(("n0.0",))
    assert board.receive("n0.0", report, 2.0, 2.0).send_stacks
    assert board.receive_stacks("n0.0", sleeping())
    assert not board.receive("n0.0", report, 3.0, 3.0).send_stacks
    assert board.stacks() == {"n0.0": sleeping()}
    # The count did not change: it still made its last progress at 1.0.
    assert board.seen()["n0.0"] == SeenProgress(report, 1.0, 1.0)


def test_ranks_record_lists_every_member_in_rank_order() -> None:
    ranks = Ranks()
    ranks.report("n0.0", 12, step=12)
    ranks.report("n2.0", 0, phase="startup")
    record = ranks_record(RING, INCARNATIONS, ranks.board.seen(), 5.0)
    assert [(r.rank, r.slot, r.step, r.phase) for r in record.ranks] == [
        (0, "n0.0", 12, None),
        (1, "n1.0", None, "startup"),
        (2, "n2.0", 0, "startup"),
    ]
    assert record.ranks[0].progressed_at == pytest.approx(1e9 + 100.0)
    assert record.ranks[2].progressed_at is None  # no step yet
