"""A Keras state's commits in its slot's snapshot folder, for ``elastic_allreduce.State`` and,
under ``elastic-run``, Horovod's own ``TensorFlowKerasState`` alike.

Both keep their last commit the same way (``ea.State`` is a ``TensorFlowKerasState``): copies
of the model's and the optimizer's variables (``_saved_model_state``,
``_saved_optimizer_state``) and the attributes (``_saved_state``, plain data once committed).
So one :class:`SlotSnapshots` writes a commit of either to the folder the agent gave the slot
(:mod:`elastic_allreduce.commits.shm`), in the checkpoint layout
(:mod:`elastic_allreduce.commits.checkpoint`: the same job and fingerprint checks, one kept), on a
thread of its own (:class:`SnapshotWriter`), and :func:`load_newest` gives a new process the
newest usable commit of its snapshot (and, for ``ea.State``, of its checkpoints). The ring's
sync then takes the newest commit of any rank (``sync.agree`` with commit ids), so a ring
that died while its agents lived resumes from its last commit in memory.

This module sits apart from :mod:`elastic_allreduce.commits.shm` (the agent imports that one
and must not import NumPy) and :mod:`elastic_allreduce.commits.checkpoint` (no TensorFlow there).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from elastic_allreduce import keras_compat, progress, runtime
from elastic_allreduce.agreement import sync
from elastic_allreduce.commits import shm
from elastic_allreduce.commits.checkpoint import CheckpointDir, Loaded, fingerprint
from elastic_allreduce.commits.persistence import AgentLink
from elastic_allreduce.errors import ConfigError, ProtocolError
from elastic_allreduce.records.values import DEFAULT_KEEP_CHECKPOINTS

log = logging.getLogger(__name__)

#: Seconds a process that exits waits for its last snapshot and checkpoint to be written.
EXIT_WAIT: Final = 60.0
#: Seconds a SIGTERMed rank 0 waits for a checkpoint under way before it writes its last commit.
SIGTERM_PERSIST_WAIT: Final = 10.0


def slot_folder() -> CheckpointDir | None:
    """This slot's snapshot folder (``ELASTIC_ALLREDUCE_SNAPSHOT_DIR``, set by the agent), kept
    to the last commit; None outside elastic-run or when the agent made none."""
    given = runtime.contract()
    if not given.snapshot_dir:
        return None
    return CheckpointDir.at(
        given.snapshot_dir, given.job_id, 1, kind="snapshot", full_hint=shm.RAISE_HINT
    )


def keep_checkpoints(given: int | None = None) -> int:
    """``given``, else the agent's ``--keep-checkpoints``, else the default (2)."""
    if given is not None:
        if given < 1:
            raise ConfigError(f"keep_checkpoints must be at least 1, got {given}")
        return given
    agents = runtime.contract().keep_checkpoints
    return DEFAULT_KEEP_CHECKPOINTS if agents is None else agents


def job_checkpoints() -> CheckpointDir | None:
    """The job's checkpoint folder (``--checkpoint-dir``, passed down by the agent), or None."""
    given = runtime.contract()
    if not given.checkpoint_dir:
        return None
    return CheckpointDir(given.checkpoint_dir, given.job_id, keep_checkpoints())


# -- a Keras state's shape and commit ----------------------------------------------------------


def state_fingerprint(state: Any) -> str:  # noqa: ANN401 - a Horovod TensorFlowKerasState
    """The state's shape as checkpoints and snapshots record it (checkpoint.fingerprint)."""
    described = sync.describe(state.model, state.optimizer, state._saved_state)
    return fingerprint((*described.model, *described.optimizer), described.extra_keys)


def save_on_sigterm(write_last_commit: Callable[[], None]) -> bool:
    """Call ``write_last_commit`` on SIGTERM (a node stopped before it could hand its state
    on: the leave timeout, a failed job, a preempted pod's last seconds), then let SIGTERM do
    what it did before: the previous handler, or death by SIGTERM. Whether it was installed
    (only the main thread can set a signal handler)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        try:
            write_last_commit()
        finally:
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def live_variables(state: Any) -> list[Any]:  # noqa: ANN401
    """The model's then the optimizer's variables: the order of a snapshot's arrays."""
    return [*state.model.variables, *keras_compat.optimizer_variables(state.optimizer)]


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

    def submit(
        self,
        state: Any,  # noqa: ANN401
        commit_id: int,
        attributes: dict[str, Any],
        checkpoint: CheckpointPersister | None = None,
    ) -> None:
        """Write ``state``'s last commit soon; one not yet written when the next comes is
        skipped. ``attributes`` are the committed ones, plain data. With ``checkpoint``, the
        commit is also persisted to the checkpoint folder once its snapshot is written (a
        newer commit's if this one is skipped)."""
        arrays = committed_arrays(state)
        if arrays is None:
            return  # cannot happen after build_optimizer
        if self._writer is None:
            self._writer = SnapshotWriter(self.folder, state_fingerprint(state))
        self._writer.submit(commit_id, arrays, attributes, checkpoint)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last commit submitted is written (or
        skipped as too big or failed); whether it is."""
        return self._writer is None or self._writer.flush(timeout)


_Commit = tuple[int, list[npt.NDArray[Any]], dict[str, Any]]
_Item = TypeVar("_Item")


class _NewestFirst(Generic[_Item]):
    """One daemon thread that handles the newest item offered: an item offered while another
    is handled waits, and a newer one replaces it (:meth:`_merge` says how). :meth:`_offer`
    never waits for the handling; :meth:`flush` does."""

    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._pending: _Item | None = None
        self._busy = False

    def _start(self, name: str) -> None:
        """Start the thread: the last step of a subclass's ``__init__``."""
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _offer(self, item: _Item) -> None:
        with self._wake:
            self._pending = item if self._pending is None else self._merge(self._pending, item)
            self._wake.notify()

    def _merge(self, waiting: _Item, newer: _Item) -> _Item:
        """What replaces ``waiting`` when ``newer`` comes before it was handled."""
        return newer

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the last item offered is handled; whether it
        was."""
        with self._wake:
            return self._wake.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None)
                item, self._pending, self._busy = self._pending, None, True
            try:
                assert item is not None
                self._handle(item)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _handle(self, item: _Item) -> None:
        raise NotImplementedError


class SnapshotWriter(_NewestFirst[tuple[_Commit, "CheckpointPersister | None"]]):
    """Writes the newest submitted commit to a slot's snapshot folder from one daemon thread;
    :meth:`submit` never waits for a write. A snapshot that would not fit in shared memory is
    skipped (warned about once per process), as is a failed write (the folder never raises).
    A commit to checkpoint is handed to its :class:`CheckpointPersister` after its snapshot."""

    def __init__(self, snapshots: CheckpointDir, state_fingerprint: str) -> None:
        super().__init__()
        self._snapshots = snapshots
        self._fingerprint = state_fingerprint
        self._warned = False
        #: The persister of the last checkpoint handed on (flushed too at exit).
        self._handed_to: CheckpointPersister | None = None
        self._start("snapshot-writer")
        atexit.register(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        """The script ended: the last commit's snapshot, then its checkpoint, before the
        daemon threads go."""
        self.flush(EXIT_WAIT)
        if self._handed_to is not None:
            self._handed_to.flush(EXIT_WAIT)

    def submit(
        self,
        commit_id: int,
        arrays: list[npt.NDArray[Any]],
        attrs: dict[str, Any],
        checkpoint: CheckpointPersister | None = None,
    ) -> None:
        """Write this commit soon (replacing one not written yet, whose checkpoint, if it was
        to have one, this one then carries)."""
        self._offer(((commit_id, arrays, attrs), checkpoint))

    def _merge(
        self,
        waiting: tuple[_Commit, CheckpointPersister | None],
        newer: tuple[_Commit, CheckpointPersister | None],
    ) -> tuple[_Commit, CheckpointPersister | None]:
        return newer if newer[1] is not None else (newer[0], waiting[1])

    def _handle(self, item: tuple[_Commit, CheckpointPersister | None]) -> None:
        commit, checkpoint = item
        written = self._write(*commit)
        if checkpoint is not None:
            self._handed_to = checkpoint
            checkpoint.submit(commit, from_snapshot=written)

    def _write(self, commit_id: int, arrays: list[npt.NDArray[Any]], attrs: dict[str, Any]) -> bool:
        """Write one snapshot; whether it was written."""
        snapshots = self._snapshots
        needed = sum(a.nbytes for a in arrays)
        if not shm.fits(needed, snapshots.path):
            if not self._warned:
                self._warned = True
                free = shm.free_bytes(snapshots.path) or 0
                log.warning(
                    "snapshots skipped: a snapshot of this state (%.1f MiB) does not fit in the "
                    "%.1f MiB of shared memory free at %s, so a restart resumes from a checkpoint "
                    "or a peer only; %s",
                    needed / 2**20,
                    free / 2**20,
                    snapshots.path,
                    shm.RAISE_HINT,
                )
            return False
        return snapshots.write(commit_id, arrays, attrs, self._fingerprint) is not None


class CheckpointPersister(_NewestFirst[tuple[_Commit, bool]]):
    """Rank 0's checkpoints off the critical path, from one daemon thread, newest first: a
    commit whose snapshot is written is persisted by the agent from it (over the
    :class:`AgentLink`, :mod:`elastic_allreduce.commits.persistence`); without an agent that does
    (none,
    it declined, it is gone, or the snapshot was skipped) the thread writes the checkpoint
    itself from the commit's arrays. ``on_persisted(commit_id)`` is called with each commit
    that reached the checkpoint folder. Writes of the thread hold ``lock``, which the state's
    own writes (on SIGTERM) hold too."""

    def __init__(
        self,
        checkpoints: CheckpointDir,
        link: AgentLink | None,
        state_fingerprint: str,
        lock: threading.RLock,
        on_persisted: Callable[[int], None],
    ) -> None:
        super().__init__()
        self._checkpoints = checkpoints
        self._link = link
        self._fingerprint = state_fingerprint
        self._lock = lock
        self._on_persisted = on_persisted
        self._start("checkpoint-persister")
        atexit.register(self.flush, EXIT_WAIT)

    def submit(self, commit: _Commit, *, from_snapshot: bool) -> None:
        """Persist this commit soon (replacing one not persisted yet); ``from_snapshot``:
        its snapshot was written, so the agent can copy it."""
        self._offer((commit, from_snapshot))

    def _handle(self, item: tuple[_Commit, bool]) -> None:
        commit, from_snapshot = item
        if not (from_snapshot and self._by_agent(commit[0])):
            self._write(*commit)

    def _by_agent(self, commit_id: int) -> bool:
        """Ask the agent; whether it took care of the commit (persisted it, or tried and
        failed: a skipped checkpoint, which its log says, counted here)."""
        if self._link is None:
            return False
        try:
            reply = self._link.persist(commit_id)
        except ProtocolError as exc:
            log.warning("writing the checkpoint of commit %d here: %s", commit_id, exc)
            return False
        if reply is None:
            log.warning(
                "writing the checkpoint of commit %d here: the agent did not answer", commit_id
            )
            self._link = None
            return False
        if reply.persisted is not None:
            with self._lock:
                self._on_persisted(reply.persisted)
            return True
        if reply.skipped is not None:
            progress.report_checkpoint_skipped(f"the agent's copy of {reply.skipped}")
            return True
        log.info("writing the checkpoint of commit %d here: %s", commit_id, reply.declined)
        return False

    def _write(self, commit_id: int, arrays: list[npt.NDArray[Any]], attrs: dict[str, Any]) -> None:
        with self._lock:
            if self._checkpoints.write(commit_id, arrays, attrs, self._fingerprint) is not None:
                self._on_persisted(commit_id)
