"""Where a Keras state's commits go once it has saved them: one pipeline for ``ea.State`` and,
under ``elastic-run``, for Horovod's own ``TensorFlowKerasState`` (through the hooks).

A :class:`CommitPipeline` belongs to one state. After each commit it hands the commit to the
slot's snapshot writer (and, on rank 0 when a checkpoint is due, to the checkpoint persister,
which the agent serves from the snapshot), or writes the checkpoint at once when the slot has
no snapshots. It loads the newest usable commit of the snapshot and the checkpoints for a new
process, and writes the last commit on SIGTERM. Every write to the checkpoint folder holds its
one lock, and :attr:`CommitPipeline.checkpointed` is the newest commit known to be there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import horovod.tensorflow as hvd
import numpy as np

from elastic_allreduce import progress
from elastic_allreduce.commits import snapshots as state_snapshots
from elastic_allreduce.commits.checkpoint import CheckpointDir
from elastic_allreduce.commits.persistence import AgentLink

log = logging.getLogger(__name__)


class CommitPipeline:
    """One state's snapshots and checkpoints (see the module docstring).

    ``state`` is a ``TensorFlowKerasState`` (``ea.State`` is one): the pipeline reads its
    committed copies (``_saved_model_state``, ``_saved_optimizer_state``, ``_saved_state``)
    and, when it loads a commit, sets its variables and attributes.
    """

    def __init__(
        self,
        state: Any,  # noqa: ANN401 - a Horovod TensorFlowKerasState
        checkpoints: CheckpointDir | None,
        snapshots: state_snapshots.SlotSnapshots | None,
    ) -> None:
        self._state = state
        self.checkpoints = checkpoints
        #: This slot's snapshots (None outside elastic-run, or when the agent made no folder).
        self.snapshots = snapshots
        if snapshots is not None:
            # The slot's folder, written by this process only: a killed predecessor's staging
            # leftover goes now (it holds shared memory).
            snapshots.prepare()
        #: Held by every write to the checkpoint folder (the persister's thread, SIGTERM's).
        self.lock = threading.RLock()
        #: The newest commit in the checkpoint folder (0: none known).
        self.checkpointed = 0
        self._persister: state_snapshots.CheckpointPersister | None = None
        self._prepared = False

    @classmethod
    def for_slot(
        cls,
        state: Any,  # noqa: ANN401
        checkpoints: CheckpointDir | None,
    ) -> CommitPipeline:
        """The pipeline of ``state`` with this slot's snapshot folder (if the agent made one)."""
        return cls(state, checkpoints, state_snapshots.SlotSnapshots.for_slot())

    def prepare_checkpoints(self) -> None:
        """Rank 0, before it first writes to the checkpoint folder (it is the only writer): a
        crashed writer's staging leftovers go. Once per process."""
        if self.checkpoints is not None and not self._prepared:
            self._prepared = True
            self.checkpoints.prepare()

    def save_on_sigterm(self, commit_id: Callable[[], int]) -> bool:
        """Write the last commit on SIGTERM (``commit_id()``: its id); whether installed."""
        return state_snapshots.save_on_sigterm(lambda: self.write_last_commit(commit_id()))

    # -- after a commit --------------------------------------------------------------------

    def keep(self, commit_id: int, attributes: dict[str, Any], *, checkpoint: bool) -> None:
        """Keep the commit the state has just saved: in the slot's snapshot, off the critical
        path; with ``checkpoint`` (rank 0, a checkpoint due) also in the checkpoint folder --
        persisted from the snapshot afterwards, or written now when there is no snapshot."""
        if self.snapshots is not None:
            persister = self.persister() if checkpoint else None
            self.snapshots.submit(self._state, commit_id, attributes, persister)
        elif checkpoint and self.checkpoints is not None:
            with progress.phase("checkpoint"):
                self.write_now(commit_id, attributes)

    def persister(self) -> state_snapshots.CheckpointPersister:
        """Rank 0's persister of checkpoints (made at the first call; needs a folder)."""
        if self._persister is None:
            if self.checkpoints is None:
                raise ValueError("no checkpoint folder to persist to")
            self._persister = state_snapshots.CheckpointPersister(
                self.checkpoints,
                AgentLink.from_env(),
                state_snapshots.state_fingerprint(self._state),
                self.lock,
                self._note_checkpointed,
            )
        return self._persister

    def write_now(self, commit_id: int, attributes: dict[str, Any]) -> None:
        """Write the commit just saved to the checkpoint folder (the live variables are it); a
        failed write is skipped with a warning."""
        assert self.checkpoints is not None
        state_snapshots.build_optimizer(self._state)
        arrays = [np.asarray(v.numpy()) for v in state_snapshots.live_variables(self._state)]
        with self.lock:
            fingerprint = state_snapshots.state_fingerprint(self._state)
            if self.checkpoints.write(commit_id, arrays, attributes, fingerprint):
                self._note_checkpointed(commit_id)

    def write_last_commit(self, commit_id: int) -> None:
        """SIGTERM on rank 0: the last commit (the saved copy, not the live variables, which
        may be steps past it) to the checkpoint folder, unless it is there already."""
        try:
            rank = hvd.rank()
        except ValueError:  # between a reset's shutdown and init: no rank to speak for
            return
        checkpoints = self.checkpoints
        if checkpoints is None or rank != 0 or commit_id <= self.checkpointed:
            return
        if self._persister is not None:
            # A copy of the agent's under way ends before the agent sends SIGTERM; its answer
            # may not have been read yet.
            self._persister.flush(state_snapshots.SIGTERM_PERSIST_WAIT)
        state = self._state
        saved = [*state._saved_model_state, *state._saved_optimizer_state]
        if len(saved) != len(state_snapshots.live_variables(state)):
            return  # the optimizer has not stepped since the commit: nothing to write yet
        with self.lock:
            if commit_id <= self.checkpointed:
                return
            log.warning("SIGTERM: writing the last commit (%d) before exiting", commit_id)
            self.prepare_checkpoints()
            arrays = [np.asarray(value) for value in saved]
            fingerprint = state_snapshots.state_fingerprint(state)
            if checkpoints.write(commit_id, arrays, dict(state._saved_state), fingerprint):
                self._note_checkpointed(commit_id)

    def _note_checkpointed(self, commit_id: int) -> None:
        """``commit_id`` is in the checkpoint folder (persisted, written or loaded)."""
        self.checkpointed = max(self.checkpointed, commit_id)

    # -- a new process -------------------------------------------------------------------------

    def load_newest(self) -> int | None:
        """Make the state the newest usable commit of this slot's snapshot and the job's
        checkpoints, whichever holds the higher commit id (the other if that one is unusable;
        the snapshot first on a tie, memory is faster to read). Its commit id, or None when
        there is none (nothing changed)."""
        folder = None if self.snapshots is None else self.snapshots.folder
        resumed = state_snapshots.load_newest(self._state, (folder, self.checkpoints))
        if resumed is None:
            return None
        commit_id = resumed[0].checkpoint.commit_id
        if resumed[1] is self.checkpoints:
            self._note_checkpointed(commit_id)
        return commit_id

    # -- waiting -------------------------------------------------------------------------------

    def wait_for_snapshot(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last commit is in this slot's snapshot
        folder (written, or skipped as too big or failed); whether it is. True at once
        without snapshots."""
        return self.snapshots is None or self.snapshots.wait(timeout)

    def wait_for_checkpoint(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last checkpoint asked for is in the
        checkpoint folder (persisted by the agent or written here, or skipped); whether it
        is. True at once when checkpoints are written at the commit itself (no snapshots)."""
        if not self.wait_for_snapshot(timeout):
            return False
        return self._persister is None or self._persister.flush(timeout)
