"""A Keras state's commits in its slot's snapshot folder, for ``elastic_allreduce.State`` and,
under ``elastic-run``, Horovod's own ``TensorFlowKerasState`` alike.

Both keep their last commit the same way (``ea.State`` is a ``TensorFlowKerasState``): copies
of the model's and the optimizer's variables (``_saved_model_state``,
``_saved_optimizer_state``) and the attributes (``_saved_state``, plain data once committed).
So one :class:`SlotSnapshots` writes a commit of either to the folder the agent gave the slot
(:mod:`elastic_allreduce.shm_snapshot`), in the checkpoint layout
(:mod:`elastic_allreduce.checkpoint`: the same job and fingerprint checks, one kept), on a
thread of its own (:class:`SnapshotWriter`), and :func:`load_newest` gives a new process the
newest usable commit of its snapshot (and, for ``ea.State``, of its checkpoints). The ring's
sync then takes the newest commit of any rank (``sync.agree`` with commit ids), so a ring
that died while its agents lived resumes from its last commit in memory.

This module sits apart from :mod:`elastic_allreduce.shm_snapshot` (the agent imports that one
and must not import NumPy) and :mod:`elastic_allreduce.checkpoint` (no TensorFlow there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from elastic_allreduce import env, shm_snapshot, sync
from elastic_allreduce.checkpoint import CheckpointDir, Loaded, fingerprint

log = logging.getLogger(__name__)


def slot_folder() -> CheckpointDir | None:
    """This slot's snapshot folder (``ELASTIC_ALLREDUCE_SNAPSHOT_DIR``, set by the agent), kept
    to the last commit; None outside elastic-run or when the agent made none."""
    folder = os.environ.get(env.SNAPSHOT_DIR)
    if not folder:
        return None
    return CheckpointDir.at(
        folder, os.environ.get(env.JOB_ID), 1, kind="snapshot", full_hint=shm_snapshot.RAISE_HINT
    )


# -- a Keras state's shape and commit ----------------------------------------------------------


def state_fingerprint(state: Any) -> str:  # noqa: ANN401 - a Horovod TensorFlowKerasState
    """The state's shape as checkpoints and snapshots record it (checkpoint.fingerprint)."""
    described = sync.describe(state.model, state.optimizer, state._saved_state)
    return fingerprint((*described.model, *described.optimizer), described.extra_keys)


def live_variables(state: Any) -> list[Any]:  # noqa: ANN401
    """The model's then the optimizer's variables: the order of a snapshot's arrays."""
    return [*state.model.variables, *state.optimizer.variables()]


def build_optimizer(state: Any) -> None:  # noqa: ANN401
    """Give an optimizer that has not stepped yet the variables a first step creates
    (unchanged values) and commit copies of them, so that the files written and read hold the
    same variables."""
    if not sync.optimizer_built(state.optimizer):
        sync.build_optimizer(state.optimizer, state.model)
        state._save_model()


def committed_arrays(state: Any) -> list[npt.NDArray[Any]] | None:  # noqa: ANN401
    """The last commit's variables as NumPy arrays -- views of the committed copies, which the
    next commit replaces instead of changing -- or None when they are incomplete (never write
    a partial state)."""
    build_optimizer(state)
    saved = [*state._saved_model_state, *state._saved_optimizer_state]
    if len(saved) != len(live_variables(state)):
        return None
    return [np.asarray(value) for value in saved]


def load_newest(
    state: Any,  # noqa: ANN401
    sources: Iterable[CheckpointDir | None],
) -> tuple[Loaded, CheckpointDir] | None:
    """Make ``state`` the newest usable commit among ``sources`` (a slot's snapshot folder, a
    checkpoint folder) and commit it: by commit id, the first source on a tie, the next one
    when that one is unusable (each is checked for the job and the state's fingerprint). The
    attributes become the stored ones. Returns what was loaded and from where, or None (then
    nothing changed)."""
    found = [
        (stored[0].commit_id, index, source)
        for index, source in enumerate(sources)
        if source is not None and (stored := source.checkpoints())
    ]
    if not found:
        return None
    build_optimizer(state)
    expected = state_fingerprint(state)
    for _, _, source in sorted(found, key=lambda item: (-item[0], item[1])):
        loaded = source.load(expected)
        if loaded is not None:
            break
    else:
        return None
    for variable, value in zip(live_variables(state), loaded.arrays, strict=True):
        variable.assign(value)
    state._saved_state = loaded.attributes
    state._set_attrs()
    state.save()
    log.info(
        "resumed from %s %s (commit %d)",
        source.kind,
        loaded.checkpoint.path,
        loaded.checkpoint.commit_id,
    )
    return loaded, source


# -- writing, off the critical path ---------------------------------------------------------


class SlotSnapshots:
    """One state's snapshots in its slot's folder: :meth:`submit` hands each commit to a
    writer thread (a write costs tens of ms at a million parameters, which must not hold the
    ring's next step); :meth:`wait` waits until the last one is written."""

    def __init__(self, folder: CheckpointDir) -> None:
        self.folder = folder
        self._writer: SnapshotWriter | None = None

    @classmethod
    def for_slot(cls) -> SlotSnapshots | None:
        """This slot's, or None outside elastic-run (or when the agent made no folder)."""
        folder = slot_folder()
        return None if folder is None else cls(folder)

    def prepare(self) -> None:
        """Before the first write: a killed predecessor's staging leftover goes (it holds
        shared memory). The folder is this slot's, written by this process only."""
        self.folder.prepare()

    def submit(self, state: Any, commit_id: int, attributes: dict[str, Any]) -> None:  # noqa: ANN401
        """Write ``state``'s last commit soon; one not yet written when the next comes is
        skipped. ``attributes`` are the committed ones, plain data."""
        arrays = committed_arrays(state)
        if arrays is None:
            return  # cannot happen after build_optimizer
        if self._writer is None:
            self._writer = SnapshotWriter(self.folder, state_fingerprint(state))
        self._writer.submit(commit_id, arrays, attributes)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last commit submitted is written (or
        skipped as too big or failed); whether it is."""
        return self._writer is None or self._writer.flush(timeout)


class SnapshotWriter:
    """Writes the newest submitted commit to a slot's snapshot folder from one daemon thread;
    :meth:`submit` never waits for a write. A snapshot that would not fit in shared memory is
    skipped (warned about once per process), as is a failed write (the folder never raises)."""

    def __init__(self, snapshots: CheckpointDir, state_fingerprint: str) -> None:
        self._snapshots = snapshots
        self._fingerprint = state_fingerprint
        self._warned = False
        self._wake = threading.Condition()
        self._pending: tuple[int, list[npt.NDArray[Any]], dict[str, Any]] | None = None
        self._busy = False
        threading.Thread(target=self._run, name="snapshot-writer", daemon=True).start()

    def submit(self, commit_id: int, arrays: list[npt.NDArray[Any]], attrs: dict[str, Any]) -> None:
        """Write this commit soon (replacing one not written yet)."""
        with self._wake:
            self._pending = (commit_id, arrays, attrs)
            self._wake.notify()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last submitted commit is written (or
        skipped); whether it was."""
        with self._wake:
            return self._wake.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None)
                assert self._pending is not None
                (commit_id, arrays, attrs), self._pending, self._busy = self._pending, None, True
            try:
                self._write(commit_id, arrays, attrs)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _write(self, commit_id: int, arrays: list[npt.NDArray[Any]], attrs: dict[str, Any]) -> None:
        snapshots = self._snapshots
        needed = sum(a.nbytes for a in arrays)
        if not shm_snapshot.fits(needed, snapshots.path):
            if not self._warned:
                self._warned = True
                free = shm_snapshot.free_bytes(snapshots.path) or 0
                log.warning(
                    "snapshots skipped: a snapshot of this state (%.1f MiB) does not fit in the "
                    "%.1f MiB of shared memory free at %s, so a restart resumes from a checkpoint "
                    "or a peer only; %s",
                    needed / 2**20,
                    free / 2**20,
                    snapshots.path,
                    shm_snapshot.RAISE_HINT,
                )
            return
        snapshots.write(commit_id, arrays, attrs, self._fingerprint)
