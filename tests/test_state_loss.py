"""launcher.leader.state_loss, step by step: which ring epochs lost the job's newest commit."""

from __future__ import annotations

from elastic_allreduce.rendezvous.protocol import Commit, ProgressReport, Synced
from launcher.leader.state_loss import (
    CheckpointSkipWatch,
    CheckpointsSkipped,
    StateLossWatch,
    StateLost,
)


def report(
    commit: tuple[int, int] | None, synced: tuple[int, int, int] | None = None
) -> ProgressReport:
    """A rank's report: its last commit (id, step) and its last sync (epoch, id, step)."""
    return ProgressReport(
        incarnation=1,
        ticks=1,
        commit=None if commit is None else Commit(*commit),
        synced=None if synced is None else Synced(synced[0], Commit(synced[1], synced[2])),
    )


def test_every_holder_died_and_the_ring_restarted_from_the_start() -> None:
    watch = StateLossWatch()
    watch.formed(1)
    assert watch.step([report((0, 0), synced=(1, 0, 0))]) == []  # the job's first sync
    assert watch.step([report((7, 70)), report((7, 70))]) == []
    assert watch.newest == Commit(7, 70)
    watch.formed(2)  # both ranks died; two new processes
    lost = watch.step([report((0, 0), synced=(2, 0, 0)), report((0, 0), synced=(2, 0, 0))])
    assert lost == [StateLost(2, Commit(7, 70), Commit(0, 0))]
    assert lost[0].steps_lost == 70
    assert lost[0].describe() == (
        "state lost: no process holding the newest commit (commit 7, step 70) survived; ring "
        "epoch 2 restarted from the start (no checkpoint), 70 steps lost"
    )
    # Judged once: later reports of the same epoch say nothing new.
    assert watch.step([report((1, 5), synced=(2, 0, 0))]) == []


def test_a_restart_from_an_older_checkpoint_names_it() -> None:
    watch = StateLossWatch()
    watch.saw(Commit(12, 120))  # rank 0's status/progress
    watch.formed(4)
    (lost,) = watch.step([report(None, synced=(4, 10, 100))])
    assert lost.steps_lost == 20
    assert "restarted from commit 10, step 100 (a checkpoint), 20 steps lost" in lost.describe()


def test_survivors_that_roll_back_to_the_newest_commit_lose_nothing() -> None:
    watch = StateLossWatch()
    watch.step([report((5, 50)), report((5, 50))])
    watch.formed(2)
    assert watch.step([report((5, 50), synced=(2, 5, 50))]) == []
    # A resize: the ranks reached a newer commit before the ring re-formed.
    watch.step([report((6, 60))])
    watch.formed(3)
    assert watch.step([report((7, 70), synced=(3, 7, 70))]) == []


def test_commits_made_after_the_epoch_formed_are_not_expected_of_its_sync() -> None:
    watch = StateLossWatch()
    watch.step([report((5, 50))])
    watch.formed(2)
    # In one step: a rank already committed past the sync, another reports its sync.
    assert (
        watch.step([report((9, 90), synced=(2, 5, 50)), report((5, 50), synced=(2, 5, 50))]) == []
    )
    assert watch.newest == Commit(9, 90)


def test_an_epoch_this_launcher_did_not_form_is_not_judged() -> None:
    """A launcher that adopted a running job knows the newest commit but not what the adopted
    ring's sync gave, long ago."""
    watch = StateLossWatch()
    watch.saw(Commit(40, 400))
    assert watch.step([report((40, 400), synced=(6, 3, 30))]) == []
    watch.formed(7)
    (lost,) = watch.step([report((0, 0), synced=(7, 0, 0))])
    assert lost.newest == Commit(40, 400)


def test_nothing_is_judged_before_any_commit_was_seen_or_without_step_numbers() -> None:
    watch = StateLossWatch()
    watch.formed(1)
    assert watch.step([report(None, synced=(1, 0, 0))]) == []  # nothing was committed yet
    watch.step([report((3, 0))])
    watch.saw(Commit(4, None))
    watch.formed(2)
    (lost,) = watch.step([report(None, synced=(2, 0, None))])
    assert lost.steps_lost is None
    assert lost.describe().endswith("restarted from the start (no checkpoint), steps lost")


def test_an_epoch_re_formed_before_anyone_synced_in_it_is_dropped() -> None:
    watch = StateLossWatch()
    watch.step([report((5, 50))])
    watch.formed(2)
    watch.formed(3)
    (lost,) = watch.step([report(None, synced=(3, 0, 0))])
    assert lost.epoch == 3
    # Epoch 2's expectation went with it: a late report of a sync in epoch 2 is not judged.
    assert watch.step([report(None, synced=(2, 0, 0))]) == []


def test_a_report_of_a_stale_commit_never_lowers_the_newest() -> None:
    watch = StateLossWatch()
    watch.step([report((8, 80)), report((3, 30))])
    watch.saw(Commit(2, 20))
    assert watch.newest == Commit(8, 80)


# -- checkpoints a process could not write --------------------------------------------------------


def skips(incarnation: int, count: int, reason: str | None = None) -> ProgressReport:
    return ProgressReport(
        incarnation, 1, checkpoints_skipped=count, checkpoint_skip=reason if count else None
    )


def test_each_new_skip_is_announced_once_per_process() -> None:
    watch = CheckpointSkipWatch()
    assert watch.step({"n0.0": skips(1, 0), "n1.0": skips(1, 0)}) == []
    assert watch.step({"n0.0": skips(1, 1, "disk full"), "n1.0": skips(1, 0)}) == [
        CheckpointsSkipped("n0.0", 1, 1, "disk full")
    ]
    assert watch.step({"n0.0": skips(1, 1, "disk full")}) == []  # the same report again
    # Two more between two looks: one announcement that says two.
    (found,) = watch.step({"n0.0": skips(1, 3, "disk full")})
    assert found == CheckpointsSkipped("n0.0", 2, 3, "disk full")
    assert "could not write 2 checkpoints (3 by this process): disk full" in found.describe()
    # A restarted process counts from zero again: its first skip is new.
    assert watch.step({"n0.0": skips(2, 1, "read-only")}) == [
        CheckpointsSkipped("n0.0", 1, 1, "read-only")
    ]
    # A slot that comes back with its old incarnation's count after being forgotten is not new
    # to itself, but the watch forgot it: it is announced again rather than missed.
    assert watch.step({}) == []
    assert watch.step({"n0.0": skips(2, 1, "read-only")}) == [
        CheckpointsSkipped("n0.0", 1, 1, "read-only")
    ]
