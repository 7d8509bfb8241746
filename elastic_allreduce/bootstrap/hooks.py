"""Small changes to Horovod's API, installed by the bootstrap under `elastic-run` only.

:func:`install` patches, in the training process before the user's script runs:

0. ``hvd.elastic.run`` (``horovod.tensorflow.elastic`` and ``horovod.tensorflow.keras.elastic``)
   becomes :func:`elastic_allreduce.training.loop.run`: Horovod's drops a failed collective whose
   op has a name of the script's, and the training function returns as if it had finished.

1. ``horovod.tensorflow.elastic.TensorFlowKerasState.sync`` (and so ``KerasState``'s): the ranks
   first agree on the state's shape (:func:`elastic_allreduce.agreement.sync.agree`). A restarted
   process
   whose Keras optimizer has not created its variables yet gets them created -- so a script
   without Horovod's warm-up step recovers instead of deadlocking -- and any other mismatch
   raises StateMismatchError on every rank. ``elastic_allreduce.State`` does the same in its
   own ``sync``. The sync is marked as a phase of :mod:`elastic_allreduce.progress` (not a
   hang) and each ``commit`` counts as progress for the launcher's hang watchdog.

   Nothing is pickled between ranks, as in ``elastic_allreduce.State``: the sync sends the extra
   attributes as JSON bytes (:func:`elastic_allreduce.agreement.sync.broadcast_attributes`, from
   rank 0
   as Horovod does) instead of ``broadcast_object``, and ``commit`` / ``check_host_updates``
   agree on host updates with one Max allreduce of integers
   (:func:`elastic_allreduce.agreement.sync.check_host_updates`) instead of a pickled broadcast --
   at a
   commit only about every 0.5 s (the votes are batched; a membership change waits that much
   longer, a failure does not). So the
   script's state attributes must be plain data (JSON values; NumPy scalars are converted):
   anything else raises StateValueError on every rank at the first sync or commit.

   Snapshots in shared memory, as ``elastic_allreduce.State`` takes them
   (:mod:`elastic_allreduce.commits.snapshots`): the state counts its commits, and each ``commit``
   also hands the committed variables and attributes to a thread that writes them to the
   slot's folder (``ELASTIC_ALLREDUCE_SNAPSHOT_DIR``, from the agent). At its first ``sync`` a
   process loads its slot's snapshot when there is one (a process restarted on its node, a
   ring that died while its agents lived), and every ``sync`` broadcasts from the lowest rank
   holding the newest commit -- not blindly from rank 0 -- so a loaded snapshot wins when it
   is newer than what the ring has, and an older one never overwrites the survivors'.
   ``state.wait_for_snapshot(timeout)`` (added to the class) waits until the last commit is
   written.

   With ``--checkpoint-dir``, rank 0's every CHECKPOINT_EVERY-th commit is also a checkpoint
   in the job's folder, as ``elastic_allreduce.State`` writes them: the agent copies the
   commit's snapshot there (:mod:`elastic_allreduce.commits.persistence`), or, without snapshots,
   the process writes it at the commit; the first sync also considers the newest checkpoint. Both
   states go through one :class:`elastic_allreduce.commits.pipeline.CommitPipeline`. On
   SIGTERM rank 0 writes its last commit there when it is newer than the newest checkpoint
   (after a copy under way), as ``elastic_allreduce.State`` does.
2. ``horovod.tensorflow.elastic._reset`` (``shutdown()`` then ``init()``, which
   ``hvd.elastic.run`` calls after each reset; it binds it when the script decorates its
   training function): a process whose slot the launcher has already left out of the next ring
   epoch -- a scale-down or a graceful leave -- exits with one line and NOT_ADMITTED_EXIT_CODE
   (a leave, for the launcher) between the two instead of entering ``hvd.init()``.
   There Horovod's background thread would receive rank -1 from the rendezvous and throw
   ``std::runtime_error("... has been removed from elastic job")``, which nothing catches: the
   C++ runtime prints ``terminate called after throwing ...`` and aborts the process.

3. ``horovod.common.basics.HorovodBasics.init`` (so every binding of ``hvd.init``:
   ``horovod.tensorflow``, its Keras API and the elastic reset all call it through the class):
   the sockets this process holds before and after it tell the bootstrap's ring guard which
   connections are Gloo's (:class:`elastic_allreduce.bootstrap.process.GlooSockets`), so that after
   a
   failed epoch it shuts down only those.

4. First of all, TensorFlow is limited to the slot's GPU
(:func:`elastic_allreduce.bootstrap.gpu.select`,
   from the agent's ``ELASTIC_ALLREDUCE_GPU_INDEX``), while every GPU of the node stays visible
   to the process for NCCL's peer-to-peer and shared-memory transports. It must happen before
   TensorFlow runs anything: :func:`install` runs before the script, and the bootstrap runs no
   TensorFlow op before it.

5. Horovod's ``DistributedGradientTape`` and ``DistributedOptimizer`` (``horovod.tensorflow``
   and its Keras API) time their allreduce for the launcher's straggler watch, as
   ``ea.DistributedGradientTape`` does (:mod:`elastic_allreduce.training.collective_clock`): plain
   Horovod custom loops and Keras ``fit`` report their wait too. Horovod's
   ``DistributedOptimizer`` refuses a Keras 3 optimizer (ConfigError naming the fix,
   :func:`elastic_allreduce.keras_compat.refuse_keras3`): Keras 3 never calls its allreduce,
   and every rank would train alone.

6. ``hvd.local_rank()`` and ``hvd.local_size()`` (``horovod.tensorflow``, its ``mpi_ops``, its
   Keras API, and ``horovod.keras``, which takes them from ``horovod.tensorflow``) keep
   Horovod's meaning for the script: the slot's index on its node -- its GPU's index, so
   ``gpus[hvd.local_rank()]`` is the process's own GPU, as
   :func:`elastic_allreduce.bootstrap.gpu.select`
   chose -- and the node's number of slots (:func:`elastic_allreduce.runtime.local_rank`).
   Horovod's C++ side keeps 0 of 1 (every slot is a host of its own); its ops
   ``local_rank_op()`` / ``local_size_op()`` still say so. Before ``hvd.init()`` they raise as
   Horovod's do.

7. A Keras ``ModelCheckpoint`` made while the process warms up at a ring of one
   (:mod:`elastic_allreduce.training.warm`) saves only while the process is rank 0 of the ring.
   Horovod's
   scripts make it on rank 0 only, before their elastic run ("to prevent other workers from
   corrupting" the files): a warm joiner is rank 0 of its ring of one there, and would
   otherwise write the same files as the ring's rank 0 once it joined (HDF5 refuses a file that
   another process has open). The decision stays the script's -- made at rank 0 -- and keeps
   that meaning in the ring.

Why the ring in the store tells: the launcher writes the next epoch (compare-and-swap) before it
notifies the members, and a slot left out of an epoch is never admitted again as the same
process, so its ``rank_and_size`` would be answered -1.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Final

import horovod.tensorflow as hvd
import horovod.tensorflow.elastic as hvd_elastic
import horovod.tensorflow.keras as hvd_keras
import horovod.tensorflow.keras.elastic as hvd_keras_elastic
import horovod.tensorflow.mpi_ops as hvd_mpi_ops
import tensorflow as tf
from horovod.common.basics import HorovodBasics
from horovod.tensorflow.functions import broadcast_variables

from elastic_allreduce import keras_compat, progress, runtime
from elastic_allreduce.agreement import sync
from elastic_allreduce.bootstrap import gpu
from elastic_allreduce.bootstrap.sockets import GlooSockets
from elastic_allreduce.commits import snapshots as state_snapshots
from elastic_allreduce.commits.pipeline import CommitPipeline
from elastic_allreduce.errors import ElasticAllreduceError
from elastic_allreduce.records import keys
from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.records.snapshot import read_ring
from elastic_allreduce.records.values import NOT_ADMITTED_EXIT_CODE, MemberRecord, Ring
from elastic_allreduce.store import EventType, Store
from elastic_allreduce.training import collective_clock, loop, warm

log = logging.getLogger(__name__)

#: How long a process of a leaving node waits, at a reset, for the launcher's next ring epoch
#: (normally written before the reset began) before it asks Horovod's rendezvous anyway.
LEAVE_WAIT: Final = 5.0

_PATCHED: Final = "_elastic_allreduce_patched"
#: What the hooks keep on a Horovod state: its commits so far (the id of its last one), its
#: commit pipeline (commits.pipeline: snapshots, checkpoints) and whether it synced.
_COMMIT_ID: Final = "_elastic_allreduce_commit_id"
_PIPELINE: Final = "_elastic_allreduce_pipeline"
_SYNCED: Final = "_elastic_allreduce_synced"
#: A Horovod state's checkpoint is every this many commits (its scripts pick when to commit;
#: ``elastic_allreduce.State`` takes ``checkpoint_every``).
CHECKPOINT_EVERY: Final = 10


def install(store: Store, gloo: GlooSockets | None = None) -> None:
    """Patch Horovod's TensorFlowKerasState.sync, elastic reset and init (idempotent). ``store``
    is the process's connection to the job's store (the bootstrap's), read at resets; ``gloo``
    learns Gloo's connections at every ``hvd.init()``. First limits TensorFlow to the slot's
    GPU (:func:`elastic_allreduce.bootstrap.gpu.select`; nothing without a GPU)."""
    gpu.select()
    if gloo is not None:
        _record_gloo_sockets(gloo)
    _time_gradient_allreduces()
    _slot_local_ranks()
    _warm_checkpoints_on_rank_zero()
    state_class: Any = hvd_elastic.TensorFlowKerasState
    if getattr(state_class.sync, _PATCHED, False):
        return
    setattr(_sync, _PATCHED, True)
    state_class.sync = _sync
    state_class.commit = _commit
    state_class.check_host_updates = _check_host_updates
    state_class.wait_for_snapshot = _wait_for_snapshot
    hvd_elastic.run = loop.run
    hvd_keras_elastic.run = loop.run
    hvd_elastic._reset = QuietReset(store)


def _time_gradient_allreduces() -> None:
    """Horovod's ``DistributedGradientTape`` and ``DistributedOptimizer`` (its TensorFlow and
    Keras bindings) give objects whose allreduce is timed for the straggler watch
    (:func:`elastic_allreduce.training.collective_clock.timed`), as ``ea``'s do."""
    for module, name in (
        (hvd, "DistributedGradientTape"),
        (hvd, "DistributedOptimizer"),
        (hvd_keras, "DistributedOptimizer"),
    ):
        original = getattr(module, name)
        if getattr(original, _PATCHED, False):
            continue

        def timed(
            *args: Any,  # noqa: ANN401
            _original: Any = original,  # noqa: ANN401
            _name: str = f"{module.__name__}.{name}",
            **kwargs: Any,  # noqa: ANN401
        ) -> Any:  # noqa: ANN401
            if _name.endswith("DistributedOptimizer"):
                keras_compat.refuse_keras3(args[0] if args else kwargs.get("optimizer"), _name)
            return collective_clock.timed(_original(*args, **kwargs))

        timed.__doc__ = original.__doc__
        timed.__name__ = name
        setattr(timed, _PATCHED, True)
        setattr(module, name, timed)


def _slot_local_ranks() -> None:
    """``hvd.local_rank()`` / ``hvd.local_size()`` as the script expects them: the slot's
    index on its node and the node's number of slots (see item 6 of the module docstring)."""
    index, size = runtime.local_rank(), runtime.local_size()
    if index is None or size is None:
        return
    for name, value in (("local_rank", index), ("local_size", size)):
        original = getattr(hvd_mpi_ops, name)
        if getattr(original, _PATCHED, False):
            continue

        def answer(_original: Any = original, _value: int = value) -> int:  # noqa: ANN401
            _original()  # raises ValueError before hvd.init(), as Horovod's does
            return _value

        answer.__doc__ = original.__doc__
        answer.__name__ = name
        setattr(answer, _PATCHED, True)
        for module in (hvd_mpi_ops, hvd, hvd_keras):
            setattr(module, name, answer)


#: Marks a ModelCheckpoint made while the process warmed up at a ring of one (item 7).
_MADE_WARM: Final = "_elastic_allreduce_made_warm"


def _warm_checkpoints_on_rank_zero() -> None:
    """A ``ModelCheckpoint`` made during a warm-up saves only on rank 0 (item 7 above)."""
    checkpoint: Any = tf.keras.callbacks.ModelCheckpoint
    save, init = checkpoint._save_model, checkpoint.__init__
    if getattr(save, _PATCHED, False):
        return

    def made(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        init(self, *args, **kwargs)
        setattr(self, _MADE_WARM, warm.provisional())

    def saved_on_rank_zero(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        if getattr(self, _MADE_WARM, False) and hvd.rank() != 0:
            if not getattr(self, "_elastic_allreduce_told", False):
                self._elastic_allreduce_told = True
                log.info(
                    "slot %s: not saving %s at rank %d: this ModelCheckpoint was made at the "
                    "ring of one this process warmed up in, as rank 0; it saves while rank 0",
                    runtime.slot(),
                    getattr(self, "filepath", "the model"),
                    hvd.rank(),
                )
            return None
        return save(self, *args, **kwargs)

    setattr(saved_on_rank_zero, _PATCHED, True)
    checkpoint.__init__ = made
    checkpoint._save_model = saved_on_rank_zero


def _sync(self: Any) -> None:  # noqa: ANN401
    """Horovod's TensorFlowKerasState.sync, after the ranks agreed on the state's shape, from
    the lowest rank holding the newest commit (first loading this slot's snapshot, at the
    process's first sync), with the extra attributes sent as JSON bytes instead of a pickle."""
    with progress.phase("sync"):
        if not getattr(self, _SYNCED, False):
            setattr(self, _SYNCED, True)
            _load_snapshot(self)
        root, commit_id = sync.agree_on_newest(
            self.model, self.optimizer, self._saved_state, _commit_id(self)
        )
        if root == 0:
            self._bcast_model()  # Horovod's own (from rank 0)
        else:
            broadcast_variables(self.model.variables, root_rank=root)
            broadcast_variables(keras_compat.optimizer_variables(self.optimizer), root_rank=root)
        self._save_model()
        if self._saved_state:
            self._saved_state = sync.broadcast_attributes(self._saved_state, root)
            self._set_attrs()
        setattr(self, _COMMIT_ID, commit_id)
        sync.restart_votes(self)


def _commit(self: Any) -> None:  # noqa: ANN401
    """Horovod's commit (save, then the host-update check), counted as progress for the hang
    watchdog and kept by the state's commit pipeline (a snapshot off the critical path, rank
    0's checkpoint every CHECKPOINT_EVERY commits); attributes that are not plain data raise
    StateValueError on every rank."""
    batch = getattr(self, "batch", None)
    progress.report_commit(batch if isinstance(batch, int) else None)
    self.save()
    refusal = sync.plain_commit(self)
    commit_id = _commit_id(self) + 1
    setattr(self, _COMMIT_ID, commit_id)
    pipeline = _pipeline(self)
    if refusal is None:
        checkpoint = (
            pipeline.checkpoints is not None
            and hvd.rank() == 0
            and commit_id % CHECKPOINT_EVERY == 0
        )
        if checkpoint:
            pipeline.prepare_checkpoints()
        pipeline.keep(commit_id, dict(self._saved_state), checkpoint=checkpoint)
    sync.check_host_updates(self, refusal, at_commit=True)


def _wait_for_snapshot(self: Any, timeout: float = 10.0) -> bool:  # noqa: ANN401
    """Wait up to ``timeout`` seconds until the last commit is in this slot's snapshot folder
    (written, or skipped as too big or failed); whether it is (True without snapshots)."""
    return _pipeline(self).wait_for_snapshot(timeout)


def _commit_id(state: Any) -> int:  # noqa: ANN401
    """The id of the state's last commit (0: none): its commits, or those of the state it
    synced from or loaded."""
    return int(getattr(state, _COMMIT_ID, 0))


def _pipeline(state: Any) -> CommitPipeline:  # noqa: ANN401
    """The state's commit pipeline, made at the first call (from the main thread: with
    --checkpoint-dir it then writes the last commit on SIGTERM)."""
    pipeline: CommitPipeline | None = getattr(state, _PIPELINE, None)
    if pipeline is None:
        pipeline = CommitPipeline.for_slot(state, state_snapshots.job_checkpoints())
        setattr(state, _PIPELINE, pipeline)
        if pipeline.checkpoints is not None:
            pipeline.save_on_sigterm(lambda: _commit_id(state))
    return pipeline


def _load_snapshot(state: Any) -> None:  # noqa: ANN401
    """Make the state the newest usable commit of this slot's snapshot and the job's
    checkpoints, when there is one (the sync that follows decides, by commit id, whether it or
    a peer's state wins)."""
    commit_id = _pipeline(state).load_newest()
    if commit_id is not None:
        setattr(state, _COMMIT_ID, commit_id)


def _check_host_updates(self: Any) -> None:  # noqa: ANN401
    """Horovod's check, agreed by a Max allreduce of integers (no pickle)."""
    sync.check_host_updates(self)


def _record_gloo_sockets(gloo: GlooSockets) -> None:
    """Bracket Horovod's init, at the class every ``hvd.init`` binding calls, with ``gloo``'s
    begin/end: Gloo connects its full mesh before ``horovod_init`` returns."""
    basics: Any = HorovodBasics
    horovod_init = basics.init
    if getattr(horovod_init, _PATCHED, False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Horovod's init; the sockets it opened are Gloo's (see GlooSockets)."""
        before = gloo.begin()
        try:
            horovod_init(self, *args, **kwargs)
        finally:
            count = gloo.end(before)
            log.debug("slot %s: hvd.init() left %d Gloo connections", runtime.slot(), count)

    setattr(init, _PATCHED, True)
    basics.init = init


class QuietReset:
    """Horovod's elastic reset (``shutdown()``, ``init()``), unless this slot was removed from
    the ring: then one line and exit code NOT_ADMITTED_EXIT_CODE."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __call__(self) -> None:
        hvd.shutdown()
        removed_in = self.removed_in_epoch()
        if removed_in is not None:
            print(
                f"slot {runtime.slot()}: removed from the job (not a member of ring epoch "
                f"{removed_in}); exiting",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(NOT_ADMITTED_EXIT_CODE)
        hvd.init()
        runtime.refresh_ring_epoch()

    def removed_in_epoch(self) -> int | None:
        """The ring epoch after this process's that leaves its slot out, or None (a member, or
        not known: then Horovod's rendezvous decides). Never raises: a store that does not
        answer leaves the decision to Horovod."""
        slot = runtime.slot()
        if slot is None:
            return None
        mine = runtime.ring_epoch()
        try:
            ring = read_ring(self._store)
            if ring is None or ring.epoch <= mine:
                if not _leaving(self._store, slot):
                    return None
                ring = _next_ring(self._store, mine, time.monotonic() + LEAVE_WAIT)
        except ElasticAllreduceError as exc:
            log.warning("slot %s: could not read the ring at a reset: %s", slot, exc)
            return None
        if ring is None or ring.epoch <= mine or slot in ring.slots:
            return None
        return ring.epoch


def _leaving(store: Store, slot: str) -> bool:
    node = split_slot(slot)[0]
    stored = store.get(keys.member(node))
    return stored is not None and MemberRecord.from_json(stored.key, stored.value).leaving


def _next_ring(store: Store, after: int, deadline: float) -> Ring | None:
    """The first ring with an epoch above ``after``, waiting for it until ``deadline``."""
    with store.watch_prefix(keys.RING) as watch:
        ring = read_ring(store)  # written between the first read and the watch's start?
        while ring is None or ring.epoch <= after:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            event = watch.get(remaining)
            if event is not None and event.type is EventType.PUT and event.kv is not None:
                ring = Ring.from_json(event.key, event.kv.value)
        return ring
