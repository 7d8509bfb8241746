"""What a training script uses: Horovod's elastic API, with commits that do more.

:class:`State` is Horovod's ``TensorFlowKerasState`` (commit / restore / sync of a Keras model,
its optimizer and any extra attributes) with four additions:

* ``sync()`` broadcasts from the rank whose commit is the newest (the lowest such rank), not
  blindly from rank 0 -- so a rank that committed one step more than a peer that failed earlier
  is never rolled back to the older state, and a worker that loaded an older checkpoint never
  overwrites the survivors; and before it broadcasts anything the ranks agree on the state's
  shape (:mod:`elastic_allreduce.agreement.sync`), so a mismatch fails on every rank instead of
  hanging;
* nothing is pickled between ranks: the extra attributes must be plain data (JSON values,
  NumPy scalars converted; anything else is refused with StateValueError naming it) and are
  synced as JSON bytes, and the host-update check is one small Max allreduce instead of
  Horovod's pickled broadcast, held at a commit about every 0.5 s instead of at each one
  (:mod:`elastic_allreduce.agreement.plain`: the ranks agree at each vote on the commit of the
  next);
* rank 0 reports each commit to the store (``status/progress``: what ``elastic-run status``
  shows);
* with a checkpoint directory (``--checkpoint-dir``), rank 0 writes every ``checkpoint_every``-th
  commit to the job's folder ``<dir>/<job-id>/``, durably, keeping the newest
  ``keep_checkpoints``; a new State loads the newest usable one (falling back to an older one
  when the newest is unreadable): the job resumes from disk when every worker died at once. A
  write that fails (a full disk) is skipped with a warning; training goes on
  (:mod:`elastic_allreduce.commits.checkpoint`);
* under ``elastic-run``, every rank also writes each commit to its slot's snapshot folder in
  shared memory, which the node's agent owns (:mod:`elastic_allreduce.commits.shm`), and a new
  State loads the newer (by commit id) of that snapshot and the newest checkpoint: a process
  restarted on its node, or a ring that died while its agents lived, resumes from its last
  commit in memory, with or without ``--checkpoint-dir``. There rank 0's checkpoints leave the
  commit: once a checkpoint's snapshot is written, the node's agent copies it into the
  checkpoint folder (:mod:`elastic_allreduce.commits.persistence`), or, without an agent that does,
  a
  thread of the process writes it.

``run`` is Horovod's, except that a failed collective is never mistaken for the end of
training (:mod:`elastic_allreduce.training.loop`). Everything else is Horovod's: reset callbacks,
``DistributedGradientTape``, and the Keras ``fit`` callbacks re-exported here.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import horovod.tensorflow as hvd
import horovod.tensorflow.keras.elastic as hvd_keras_elastic
import numpy as np
import numpy.typing as npt
import tensorflow as tf
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.tensorflow.elastic import TensorFlowKerasState
from horovod.tensorflow.functions import broadcast_variables
from typing_extensions import Unpack

from elastic_allreduce import keras_compat, progress, runtime
from elastic_allreduce.agreement import plain, sync
from elastic_allreduce.agreement.sync import agree
from elastic_allreduce.commits import snapshots as state_snapshots
from elastic_allreduce.commits.checkpoint import CheckpointDir
from elastic_allreduce.commits.pipeline import CommitPipeline
from elastic_allreduce.errors import ConfigError, StateValueError
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import Progress
from elastic_allreduce.store.latest import LatestValueWriter
from elastic_allreduce.training import API, collective_clock, loop, tensorboard, warm
from elastic_allreduce.training.audit import SampleLog
from elastic_allreduce.training.data import (
    ArraySource,
    EpochSharding,
    RecordSource,
    Share,
    Source,
    SupportsRecords,
    TFRecordSource,
    global_batch_for,
)

log = logging.getLogger(__name__)

init = hvd.init
shutdown = hvd.shutdown
rank = hvd.rank
size = hvd.size
allreduce = hvd.allreduce
warm_up = warm.warm_up


def local_rank() -> int:
    """This process's local rank: under `elastic-run` its slot's index on its node (its GPU's
    index; :func:`elastic_allreduce.runtime.local_rank`), elsewhere Horovod's. ValueError
    before :func:`init`, as Horovod's."""
    horovods = hvd.local_rank()
    mine = runtime.local_rank()
    return horovods if mine is None else mine


def local_size() -> int:
    """How many training processes this process's node runs: under `elastic-run` its
    ``--nproc-per-node``, elsewhere Horovod's local size. ValueError before :func:`init`."""
    horovods = hvd.local_size()
    mine = runtime.local_size()
    return horovods if mine is None else mine


def DistributedGradientTape(tape: tf.GradientTape, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - Horovod's name
    """Horovod's ``DistributedGradientTape`` (same arguments), with its allreduce timed for the
    launcher's straggler watch (:mod:`elastic_allreduce.training.collective_clock`)."""
    return collective_clock.timed(hvd.DistributedGradientTape(tape, *args, **kwargs))


def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - Horovod's name
    """Horovod's ``DistributedOptimizer`` (same arguments) for legacy Keras optimizers, and its
    Keras 3 counterpart for Keras 3's (:func:`keras_compat.distributed_optimizer`), with the
    allreduce timed for the launcher's straggler watch
    (:mod:`elastic_allreduce.training.collective_clock`)."""
    if keras_compat.is_keras3(optimizer):
        reducing = keras_compat.distributed_optimizer(optimizer, *args, **kwargs)
        return collective_clock.timed(reducing)
    return collective_clock.timed(hvd.DistributedOptimizer(optimizer, *args, **kwargs))


run = loop.run


@dataclass(frozen=True)
class Batch:
    """One rank's part of one global step.

    Train on ``tf.reduce_sum(per_example_loss) * loss_scale``: with an averaging allreduce the
    gradient is then the mean over the whole global batch, whatever each rank's share (a rank
    whose share is empty at the end of an epoch contributes zero).
    """

    features: Any
    labels: Any
    ids: npt.NDArray[np.int64]
    global_size: int
    loss_scale: float


class DataOptions(TypedDict, total=False):
    """The batching options of :class:`ElasticData`, for its ``from_*`` constructors."""

    batch_per_rank: int
    global_batch: int | None
    seed: int
    shuffle: bool
    drop_remainder: bool


class ElasticData:
    """Exactly-once batches for tf.data (see :mod:`elastic_allreduce.training.data`).

    The samples come from in-memory arrays (``ElasticData(features, labels)``), any indexable
    record collection (:meth:`from_records`), TFRecord shards (:meth:`from_tfrecords`) or any
    :class:`~elastic_allreduce.training.data.Source`. The state must carry ``epoch``, ``position``
    and
    ``step`` (``State(..., epoch=0, position=0, step=0)``).

    Custom loops: ``batches(state)`` yields this rank's batches from the committed position to
    the end of the state's epoch (prefetched by ``tf.data``); call ``advance(state, batch)``
    after each step. Keras ``fit``: ``keras_feed(state)`` gives the dataset and the callback for
    one data epoch. With ``global_batch`` the global batch stays fixed across resizes; otherwise
    it is ``batch_per_rank`` x the number of ranks.
    """

    def __init__(
        self,
        features: npt.ArrayLike | Source,
        labels: npt.ArrayLike | None = None,
        *,
        parse: Callable[..., tuple[Any, Any]] | None = None,
        batch_per_rank: int = 32,
        global_batch: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_remainder: bool = False,
    ) -> None:
        if isinstance(features, Source):
            if labels is not None:
                raise ConfigError("pass labels inside the source, not next to it")
            self.source = features
        else:
            if labels is None:
                raise ConfigError("ElasticData(features, labels): the labels are missing")
            self.source = ArraySource(features, labels)
        self._parse = parse
        self._policy = "fixed" if global_batch else "linear"
        self._batch_per_rank = batch_per_rank
        self._global_batch = global_batch
        self.sharding = EpochSharding(len(self.source), seed, shuffle, drop_remainder)
        sample = self.source.fetch(np.zeros(1, np.int64))
        if parse is None and len(sample) != 2:
            raise ConfigError(
                f"the source gives {len(sample)} arrays per batch; without parse= it must give "
                "two (features, labels)"
            )
        self._signature = tuple(
            tf.TensorSpec(
                (None, *part.shape[1:]),
                tf.string if part.dtype == object else tf.as_dtype(part.dtype),
            )
            for part in sample
        )
        self._log = SampleLog()

    @classmethod
    def from_records(cls, records: SupportsRecords, **options: Unpack[DataOptions]) -> ElasticData:
        """Samples from ``records[i]`` (a ``(features, label)`` tuple each); see RecordSource."""
        return cls(RecordSource(records), **options)

    @classmethod
    def from_tfrecords(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        parse: Callable[[tf.Tensor], tuple[Any, Any]],
        *,
        counts: Sequence[int] | None = None,
        **options: Unpack[DataOptions],
    ) -> ElasticData:
        """Samples from uncompressed TFRecord shards; ``parse`` maps a batch of serialized
        records (a string tensor) to ``(features, labels)`` inside the tf.data pipeline."""
        return cls(TFRecordSource(paths, counts), parse=parse, **options)

    # -- planning ----------------------------------------------------------------------------

    def _plan(self, state: State) -> _Plan:
        rank, size = hvd.rank(), hvd.size()
        batch = global_batch_for(self._policy, self._batch_per_rank, self._global_batch, size)
        epoch, position = int(state.epoch), int(state.position)
        shares = []
        while (share := self.sharding.share(epoch, position, batch, rank, size)) is not None:
            shares.append(share)
            position += share.global_size
        return _Plan(runtime.ring_epoch(), epoch, int(state.step), rank, size, tuple(shares))

    def _dataset(self, plan: _Plan) -> tf.data.Dataset:
        """(features, labels, loss_scale) per step of the plan, prefetched."""

        def generate() -> Iterator[tuple[Any, ...]]:
            for share in plan.shares:
                yield (*self.source.fetch(share.ids), np.float32(plan.size / share.global_size))

        signature = (*self._signature, tf.TensorSpec((), tf.float32))
        dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
        # A known length: Keras then never announces a batch past the plan's end.
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(plan.shares)))
        if self._parse is not None:
            parse = self._parse

            def parsed(*parts: tf.Tensor) -> tuple[Any, Any, tf.Tensor]:
                features, labels = parse(*parts[:-1])
                return features, labels, parts[-1]

            dataset = dataset.map(parsed, num_parallel_calls=tf.data.AUTOTUNE)
        return dataset.prefetch(tf.data.AUTOTUNE)

    # -- custom training loops ---------------------------------------------------------------

    def batches(self, state: State) -> Iterator[Batch]:
        """This rank's batches from ``state.position`` to the end of ``state.epoch``."""
        plan = self._plan(state)
        for offset, (share, (features, labels, scale)) in enumerate(
            zip(plan.shares, self._dataset(plan), strict=True)
        ):
            self._log.record(plan.ring, plan.epoch, plan.first_step + offset, plan.rank, share.ids)
            yield Batch(features, labels, share.ids, share.global_size, float(scale))

    @staticmethod
    def advance(state: State, batch: Batch, metrics: Mapping[str, float] | None = None) -> None:
        """Count a finished step: the epoch position moves past the whole global batch.
        ``metrics`` (such as ``{"loss": loss}``) go to TensorBoard with ``--tensorboard-dir``."""
        state.position += batch.global_size
        state.step += 1
        progress.report_step(int(state.step), samples=batch.global_size, metrics=metrics)

    @staticmethod
    def next_epoch(state: State) -> None:
        """Start the next data epoch at position 0."""
        state.epoch += 1
        state.position = 0

    # -- Keras fit -----------------------------------------------------------------------------

    def keras_feed(self, state: State, *, commit_every: int = 10) -> KerasFeed:
        """The rest of ``state.epoch`` for one ``model.fit(feed.dataset, callbacks=[feed.callback,
        ...])`` call: ``(features, labels, sample_weight)`` batches whose weights make Keras'
        mean loss the share of the global batch's mean (so the averaged gradient is exact), and
        a callback that logs each step before it runs, advances the state after it and commits
        every ``commit_every`` steps. Then call ``next_epoch(state)`` and ``state.commit()``."""
        if commit_every < 1:
            raise ConfigError(f"commit_every must be at least 1, got {commit_every}")
        plan = self._plan(state)

        def weighted(
            features: tf.Tensor, labels: tf.Tensor, scale: tf.Tensor
        ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
            count = tf.shape(tf.nest.flatten(labels)[0])[0]
            return features, labels, tf.fill([count], scale * tf.cast(count, tf.float32))

        dataset = self._dataset(plan).map(weighted)
        return KerasFeed(
            dataset, _FeedCallback(self._log, plan, state, commit_every), len(plan.shares)
        )


@dataclass(frozen=True)
class _Plan:
    """This rank's shares of the steps left in one data epoch, from one committed position."""

    ring: int
    epoch: int
    first_step: int
    rank: int
    size: int
    shares: tuple[Share, ...]


@dataclass(frozen=True)
class KerasFeed:
    """What ``model.fit`` needs for one data epoch of :class:`ElasticData`.

    ``steps`` is how many steps are left in the epoch: skip ``fit`` when it is 0 (a rollback to a
    commit taken at the very end of an epoch leaves nothing to run, and Keras refuses an empty
    dataset).
    """

    dataset: tf.data.Dataset
    callback: tf.keras.callbacks.Callback
    steps: int


class _FeedCallback(tf.keras.callbacks.Callback):  # type: ignore[misc]
    """Audit line before each step; position, step and commits after it."""

    def __init__(self, sample_log: SampleLog, plan: _Plan, state: State, commit_every: int) -> None:
        super().__init__()
        self._sample_log = sample_log
        self._plan = plan
        self._state = state
        self._commit_every = commit_every

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        steps = getattr(self.model, "_steps_per_execution", None)
        if steps is not None and int(steps.numpy()) != 1:
            raise ConfigError(
                "ElasticData's Keras feed needs steps_per_execution=1 in model.compile: it "
                "accounts for every step"
            )

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        plan = self._plan
        ids = plan.shares[batch].ids
        self._sample_log.record(plan.ring, plan.epoch, plan.first_step + batch, plan.rank, ids)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._state.position += self._plan.shares[batch].global_size
        self._state.step += 1
        global_size = self._plan.shares[batch].global_size
        progress.report_step(int(self._state.step), samples=global_size, metrics=logs)
        if self._state.step % self._commit_every == 0:
            self._state.commit()


class ScaleLearningRate:
    """Resize policy: learning rate = ``base_lr`` x ranks (Horovod's convention when each rank
    keeps its batch size, so the global batch grows with the ranks)."""

    def __init__(self, optimizer: tf.keras.optimizers.Optimizer, base_lr: float) -> None:
        self._optimizer = optimizer
        self._base_lr = base_lr

    def __call__(self, old_size: int, new_size: int) -> None:
        self._optimizer.learning_rate.assign(self._base_lr * new_size)


class State(TensorFlowKerasState):  # type: ignore[misc]
    """Elastic training state of a Keras model and optimizer (see the module docstring).

    Extra keyword arguments become attributes that are committed, restored and synced with the
    model (for example ``step=0, epoch=0``). They must be plain data -- None, bool, int, float,
    str, lists of these and dicts with str keys; NumPy scalars are converted -- since the ranks
    exchange them as JSON: anything else raises StateValueError here or at the commit.
    ``checkpoint_dir`` (default: ``--checkpoint-dir``), ``checkpoint_every`` (in commits) and
    ``keep_checkpoints`` (default: ``--keep-checkpoints``, else 2) set the checkpoints; they go
    to ``<checkpoint_dir>/<job-id>/`` (``default`` for a script run outside elastic-run).
    ``on_resize(old_size, new_size)`` is the job's resize policy beyond the batch (for example
    :class:`ScaleLearningRate`); it runs at start (old size 0) and after every reset that changed
    the number of ranks, on every rank.
    """

    _saved_state: dict[str, Any]
    commit_id: int

    def __init__(
        self,
        model: tf.keras.Model,
        optimizer: tf.keras.optimizers.Optimizer | None = None,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 10,
        keep_checkpoints: int | None = None,
        on_resize: Callable[[int, int], None] | None = None,
        **kwargs: object,
    ) -> None:
        if checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        given = runtime.contract()
        directory = checkpoint_dir or given.checkpoint_dir
        self._checkpoints = (
            CheckpointDir(
                directory,
                given.job_id,
                state_snapshots.keep_checkpoints(keep_checkpoints),
            )
            if directory
            else None
        )
        self._checkpoint_every = checkpoint_every
        self._reporter: LatestValueWriter | None = None
        attributes = plain.plain_attributes(kwargs)
        super().__init__(model, optimizer, commit_id=0, **attributes)
        # Horovod's way to send objects between ranks (cloudpickle); this class never uses it.
        self._bcast_object = _no_pickles
        #: Where the commits go: snapshots, checkpoints (commits.pipeline).
        self._commits = CommitPipeline.for_slot(self, self._checkpoints)
        #: Whether rank 0 has cleaned the checkpoint folder up (if this is rank 0): a warm
        #: joiner is rank 0 of a ring of its own until it joins, and does it then (at its
        #: first reset) if it is rank 0 of the ring (elastic_allreduce.training.warm).
        self._checkpoint_folder_checked = not warm.provisional()
        if self._checkpoint_folder_checked and self._checkpoints is not None and hvd.rank() == 0:
            # The only writer: a crashed writer's staging leftovers go now.
            self._commits.prepare_checkpoints()
        self._commits.load_newest()
        if self._checkpoints is not None:
            self._commits.save_on_sigterm(lambda: int(self._saved_state.get("commit_id", 0)))
        self._on_resize = on_resize
        self._size = hvd.size()
        if on_resize is not None:
            on_resize(0, self._size)
        #: Steps lost at the last restore (None: no failure since the last reset).
        self._rolled_back: int | None = None
        self._summaries = tensorboard.attach(tensorboard.learning_rate_of(self.optimizer))
        # A warm joiner is rank 0 of a ring of its own, which is no ring of the job: it says
        # where it stands when it joins (on_reset), and writes only if it is rank 0 there.
        if self._summaries is not None and not warm.provisional():
            self._summaries.ring(
                rank=hvd.rank(),
                size=self._size,
                epoch=runtime.ring_epoch(),
                step=self._current_step(),
                cause=None,
            )

    # -- commit / sync -----------------------------------------------------------------------

    def commit(self) -> None:
        """Save the state in memory (and maybe to disk); raise if membership changed, and
        StateValueError (on every rank) if an attribute is not plain data."""
        self.commit_id += 1
        self.save()
        refusal = sync.plain_commit(self)
        if refusal is None:
            step = getattr(self, "step", None)
            progress.report_commit(step if isinstance(step, int) else None, self.commit_id)
            checkpoint = (
                hvd.rank() == 0
                and self._checkpoints is not None
                and self.commit_id % self._checkpoint_every == 0
            )
            self._commits.keep(self.commit_id, dict(self._saved_state), checkpoint=checkpoint)
            if hvd.rank() == 0:
                self._report()
            if self._summaries is not None:
                self._summaries.on_commit(self._current_step())
        try:
            sync.check_host_updates(self, refusal, at_commit=True)
        except HostsUpdatedInterrupt:
            if self._summaries is not None:
                # Before a leaving rank 0 exits and the next one writes a file of its own.
                self._summaries.flush()
            raise

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank at once if hosts were added or removed
        (Horovod's check, agreed by a Max allreduce of integers: :func:`sync.check_host_updates`).
        Called by the script, the ranks vote now; a commit votes about every 0.5 s only
        (``ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL``)."""
        sync.check_host_updates(self)

    def restore(self) -> None:
        """Go back to the last commit (after a failure); the steps lost are reported."""
        before = getattr(self, "step", None)
        super().restore()
        after = getattr(self, "step", None)
        lost = 0
        if isinstance(before, int) and isinstance(after, int) and before > after:
            lost = before - after
            progress.report_rollback(lost)
        self._rolled_back = lost

    def on_reset(self) -> None:
        """After Horovod re-initialised: learn the new ring epoch, then run reset callbacks."""
        epoch = runtime.refresh_ring_epoch()
        if not self._checkpoint_folder_checked and self._checkpoints is not None:
            self._checkpoint_folder_checked = True
            if hvd.rank() == 0:
                self._commits.prepare_checkpoints()
        super().on_reset()
        size = hvd.size()
        if self._on_resize is not None and size != self._size:
            self._on_resize(self._size, size)
        self._size = size
        lost, self._rolled_back = self._rolled_back, None
        if self._summaries is not None:
            cause = "resize" if lost is None else f"failure, {lost} steps rolled back"
            step = self._current_step()
            self._summaries.ring(rank=hvd.rank(), size=size, epoch=epoch, step=step, cause=cause)

    def _current_step(self) -> int:
        """The state's ``step`` attribute, else the step the progress counters last saw."""
        step = getattr(self, "step", None)
        try:
            return int(step)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return progress.current_step()

    def sync(self) -> None:
        """Give every rank the newest committed state (from the lowest rank that has it).

        The ranks first agree on the state's shape
        (:func:`elastic_allreduce.agreement.sync.agree`): a
        mismatch raises StateMismatchError on every rank instead of deadlocking the broadcasts.
        The variables are broadcast as tensors, the extra attributes as JSON bytes
        (:func:`elastic_allreduce.agreement.sync.broadcast_attributes`).
        """
        with progress.phase("sync"):
            commit_id = int(self._saved_state.get("commit_id", 0))
            root = agree(self.model, self.optimizer, self._saved_state, commit_id=commit_id)
            broadcast_variables(self.model.variables, root_rank=root)
            broadcast_variables(keras_compat.optimizer_variables(self.optimizer), root_rank=root)
            self._save_model()
            self._saved_state = sync.broadcast_attributes(self._saved_state, root)
            self._set_attrs()
        sync.restart_votes(self)
        step = getattr(self, "step", None)
        progress.report_sync(
            runtime.ring_epoch(), self.commit_id, step if isinstance(step, int) else None
        )

    # -- progress ------------------------------------------------------------------------------

    def _report(self) -> None:
        given = runtime.contract()
        if not given.job_id or not given.etcd:
            return
        if self._reporter is None:
            self._reporter = _progress_writer()
        self._reporter.submit(Progress.of(self._saved_state, hvd.size()).to_json())

    # -- checkpoints ---------------------------------------------------------------------------

    def wait_for_checkpoint(self, timeout: float = 60.0) -> bool:
        """Wait up to ``timeout`` seconds until the last checkpoint asked for is in the
        checkpoint folder (persisted by the agent or written here, or skipped); whether it is.
        True at once when checkpoints are written at the commit itself (no snapshots)."""
        return self._commits.wait_for_checkpoint(timeout)

    def wait_for_snapshot(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` seconds until the last commit is in this slot's snapshot
        folder (written, or skipped as too big or failed); whether it is. True at once without
        snapshots (outside elastic-run)."""
        return self._commits.wait_for_snapshot(timeout)


def _no_pickles(obj: object, root_rank: int = 0) -> object:
    """Stands in for Horovod's ``broadcast_object`` in :class:`State`, which sends plain data
    only: a Horovod code path that would pickle fails here instead."""
    raise StateValueError(
        f"elastic_allreduce.State does not send Python objects between ranks (a "
        f"{type(obj).__name__} was about to be pickled); its attributes go as JSON"
    )


__all__ = list(API)

#: Horovod's Keras state callbacks, unchanged, as ``ea.*``.
CommitStateCallback = hvd_keras_elastic.CommitStateCallback
UpdateBatchStateCallback = hvd_keras_elastic.UpdateBatchStateCallback
UpdateEpochStateCallback = hvd_keras_elastic.UpdateEpochStateCallback


def _progress_writer() -> LatestValueWriter:
    """Rank 0's ``status/progress`` writer: in the background, so a commit never waits for
    etcd (during an outage the writes wait it out, the steps do not); flushed at exit."""
    from elastic_allreduce.store import EtcdStore  # noqa: PLC0415

    def open_store() -> EtcdStore:
        given = runtime.contract()
        assert given.etcd is not None and given.job_id is not None  # checked by _report
        return EtcdStore(given.etcd, given.job_id, outage_timeout=given.outage_timeout)

    writer = LatestValueWriter(open_store, keys.PROGRESS)
    atexit.register(writer.close)
    return writer
