"""Whether a ring lost the job's newest commit, and which processes could not write a
checkpoint: pure, stepped by the launcher (no I/O).

Every rank of an ``ea.State`` script reports its last commit (id and step) and, after each
state sync, the ring epoch it synced in and the commit the sync gave it
(:class:`~elastic_allreduce.rendezvous.protocol.ProgressReport`); rank 0 also writes each commit
to ``status/progress``. The watch keeps the newest commit any of them showed. When the
launcher forms a ring epoch, the newest commit seen until then is what that epoch's sync must
give back, since the survivors of a failure roll back to it and a resize waits for the next
commit. A rank that syncs in that epoch to an *older* commit means no holder of the newest one
survived (every process that had it died at once, and the ring started again from a checkpoint
or from the start): the steps in between were lost. Each epoch is judged once.

What is seen is a lower bound of what was committed (reports come about once a second), so a
loss of the last few commits may go unseen, but no loss is ever reported that did not happen.
Only epochs this launcher formed are judged: a launcher that adopts a running job does not know
what the adopted ring's sync gave. Plain Horovod scripts report no commits and are not judged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastic_allreduce.rendezvous.protocol import Commit, ProgressReport


@dataclass(frozen=True)
class StateLost:
    """Ring epoch ``epoch`` synced to ``resumed``, older than the ``newest`` commit seen."""

    epoch: int
    newest: Commit
    resumed: Commit

    @property
    def steps_lost(self) -> int | None:
        """Steps between the two commits (None when the script has no ``step`` attribute)."""
        if self.newest.step is None or self.resumed.step is None:
            return None
        return self.newest.step - self.resumed.step

    def describe(self) -> str:
        """One line for the log, the event and the job's failure reason."""
        lost = self.steps_lost
        steps = f"{lost} steps" if lost is not None else "steps"
        newest = _commit(self.newest)
        if self.resumed.commit_id == 0:
            start = "the start (no checkpoint)"
        else:
            start = f"{_commit(self.resumed)} (a checkpoint)"
        return (
            f"state lost: no process holding the newest commit ({newest}) survived; ring "
            f"epoch {self.epoch} restarted from {start}, {steps} lost"
        )


def _commit(commit: Commit) -> str:
    if commit.step is None:
        return f"commit {commit.commit_id}"
    return f"commit {commit.commit_id}, step {commit.step}"


class StateLossWatch:
    """Judges each ring epoch's sync against the newest commit seen before it formed."""

    def __init__(self) -> None:
        self._newest: Commit | None = None
        #: Epochs formed by this launcher -> the newest commit seen before (None: none yet).
        self._expected: dict[int, Commit | None] = {}
        self._judged: set[int] = set()

    @property
    def newest(self) -> Commit | None:
        return self._newest

    def saw(self, commit: Commit | None) -> None:
        """A commit that happened (rank 0's ``status/progress``, a rank's report)."""
        newest = self._newest
        if commit is not None and (newest is None or commit.commit_id > newest.commit_id):
            self._newest = commit

    def formed(self, epoch: int) -> None:
        """The launcher wrote ring epoch ``epoch``: its sync must give back the newest
        commit seen so far."""
        self._expected.setdefault(epoch, self._newest)

    def step(self, reports: Iterable[ProgressReport]) -> list[StateLost]:
        """Look at the ranks' last reports: a loss for each newly judged epoch that synced to
        an older commit than expected."""
        reports = list(reports)
        found: list[StateLost] = []
        for report in reports:
            synced = report.synced
            if synced is None or synced.epoch in self._judged:
                continue
            if synced.epoch not in self._expected:
                continue  # formed before this launcher led the job
            self._judged.add(synced.epoch)
            expected = self._expected.pop(synced.epoch)
            for older in [e for e in self._expected if e < synced.epoch]:
                del self._expected[older]  # re-formed again before any rank synced in it
            if expected is not None and synced.commit.commit_id < expected.commit_id:
                found.append(StateLost(synced.epoch, expected, synced.commit))
        # After judging: this step's reports may hold commits made after a sync just judged.
        for report in reports:
            self.saw(report.commit)
        return found


@dataclass(frozen=True)
class CheckpointsSkipped:
    """``slot`` reported ``new`` more checkpoints it could not write (``total`` in all by that
    process), the last one for ``reason``."""

    slot: str
    new: int
    total: int
    reason: str | None

    def describe(self) -> str:
        what = "a checkpoint" if self.new == 1 else f"{self.new} checkpoints"
        return (
            f"slot {self.slot} could not write {what} ({self.total} by this process): "
            f"{self.reason or 'no reason given'}; training goes on from the previous ones"
        )


class CheckpointSkipWatch:
    """Which processes report checkpoints they could not write that were not announced yet
    (each process counts its own: ``ProgressReport.checkpoints_skipped``)."""

    def __init__(self) -> None:
        self._announced: dict[tuple[str, int], int] = {}

    def step(self, reports: Mapping[str, ProgressReport]) -> list[CheckpointsSkipped]:
        """The new skips since the last step, one per process that has any."""
        found = []
        announced = {}
        for slot, report in sorted(reports.items()):
            key = (slot, report.incarnation)
            before = self._announced.get(key, 0)
            announced[key] = max(before, report.checkpoints_skipped)
            if report.checkpoints_skipped > before:
                found.append(
                    CheckpointsSkipped(
                        slot,
                        report.checkpoints_skipped - before,
                        report.checkpoints_skipped,
                        report.checkpoint_skip,
                    )
                )
        self._announced = announced  # processes that no longer report are forgotten
        return found
