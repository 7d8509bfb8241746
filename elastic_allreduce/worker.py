"""What a training script uses: Horovod's elastic API, with commits that do more.

:class:`State` is Horovod's ``TensorFlowKerasState`` (commit / restore / sync of a Keras model,
its optimizer and any extra attributes) with three additions:

* ``sync()`` broadcasts from the rank whose commit is the newest (the lowest such rank), not
  blindly from rank 0 -- so a rank that committed one step more than a peer that failed earlier
  is never rolled back to the older state, and a worker that loaded an older checkpoint never
  overwrites the survivors;
* rank 0 reports each commit to the store (``status/progress``: what ``elastic-run status``
  shows);
* with a checkpoint directory (``--checkpoint-dir``), rank 0 writes every ``checkpoint_every``-th
  commit to disk, atomically, and a new State loads the newest checkpoint: the job resumes from
  disk when every worker died at once.

Everything else is Horovod's: ``run``, reset callbacks, ``DistributedGradientTape``, and the
Keras ``fit`` callbacks re-exported here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import numpy.typing as npt
import tensorflow as tf
from horovod.tensorflow.elastic import TensorFlowKerasState
from horovod.tensorflow.elastic import run as _horovod_run
from horovod.tensorflow.functions import allgather_object, broadcast_object, broadcast_variables
from horovod.tensorflow.keras.elastic import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)

from elastic_allreduce import env, runtime
from elastic_allreduce.audit import SampleLog
from elastic_allreduce.data import EpochSharding, global_batch_for
from elastic_allreduce.errors import ConfigError, ElasticAllreduceError

log = logging.getLogger(__name__)

init = hvd.init
shutdown = hvd.shutdown
rank = hvd.rank
size = hvd.size
local_rank = hvd.local_rank
allreduce = hvd.allreduce
DistributedGradientTape = hvd.DistributedGradientTape
DistributedOptimizer = hvd.DistributedOptimizer
run = _horovod_run

_LATEST = "LATEST"


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


class ElasticData:
    """Exactly-once batches of in-memory arrays (see :mod:`elastic_allreduce.data`).

    The state must carry ``epoch``, ``position`` and ``step`` (``State(..., epoch=0,
    position=0, step=0)``). ``batches(state)`` yields this rank's batches from the committed
    position to the end of the state's epoch, prefetched by ``tf.data``; call
    ``advance(state, batch)`` after each step. With ``global_batch`` the global batch stays
    fixed across resizes; otherwise it is ``batch_per_rank`` x the number of ranks.
    """

    def __init__(
        self,
        features: npt.ArrayLike,
        labels: npt.ArrayLike,
        *,
        batch_per_rank: int = 32,
        global_batch: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_remainder: bool = False,
    ) -> None:
        self._features = np.asarray(features)
        self._labels = np.asarray(labels)
        if len(self._features) != len(self._labels):
            raise ConfigError(
                "features and labels differ in length: "
                f"{len(self._features)} vs {len(self._labels)}"
            )
        self._policy = "fixed" if global_batch else "linear"
        self._batch_per_rank = batch_per_rank
        self._global_batch = global_batch
        self.sharding = EpochSharding(len(self._features), seed, shuffle, drop_remainder)
        self._log = SampleLog()

    def batches(self, state: State) -> Iterator[Batch]:
        """This rank's batches from ``state.position`` to the end of ``state.epoch``."""
        rank, size = hvd.rank(), hvd.size()
        batch = global_batch_for(self._policy, self._batch_per_rank, self._global_batch, size)
        epoch, position, first_step = int(state.epoch), int(state.position), int(state.step)
        plan = []
        while (share := self.sharding.share(epoch, position, batch, rank, size)) is not None:
            plan.append(share)
            position += share.global_size

        def generate() -> Iterator[tuple[Any, Any]]:
            for share in plan:
                yield self._features[share.ids], self._labels[share.ids]

        signature = (
            tf.TensorSpec((None, *self._features.shape[1:]), tf.as_dtype(self._features.dtype)),
            tf.TensorSpec((None, *self._labels.shape[1:]), tf.as_dtype(self._labels.dtype)),
        )
        dataset = tf.data.Dataset.from_generator(generate, output_signature=signature).prefetch(2)
        ring = runtime.ring_epoch()
        for offset, (share, (features, labels)) in enumerate(zip(plan, dataset, strict=True)):
            self._log.record(ring, epoch, first_step + offset, rank, share.ids.tolist())
            yield Batch(features, labels, share.ids, share.global_size, size / share.global_size)

    @staticmethod
    def advance(state: State, batch: Batch) -> None:
        """Count a finished step: the epoch position moves past the whole global batch."""
        state.position += batch.global_size
        state.step += 1

    @staticmethod
    def next_epoch(state: State) -> None:
        """Start the next data epoch at position 0."""
        state.epoch += 1
        state.position = 0


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
    model (for example ``step=0, epoch=0``); checkpoints need them to be JSON values.
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
        on_resize: Callable[[int, int], None] | None = None,
        **kwargs: object,
    ) -> None:
        if checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        directory = checkpoint_dir or os.environ.get(env.CHECKPOINT_DIR)
        self._checkpoint_dir = Path(directory) if directory else None
        self._checkpoint_every = checkpoint_every
        self._reporter: Any = None
        super().__init__(model, optimizer, commit_id=0, **kwargs)
        if self._checkpoint_dir is not None:
            self._load_checkpoint(self._checkpoint_dir)
        self._on_resize = on_resize
        self._size = hvd.size()
        if on_resize is not None:
            on_resize(0, self._size)

    # -- commit / sync -----------------------------------------------------------------------

    def commit(self) -> None:
        """Save the state in memory (and maybe to disk); raise if membership changed."""
        self.commit_id += 1
        self.save()
        if hvd.rank() == 0:
            self._report()
            if self._checkpoint_dir is not None and self.commit_id % self._checkpoint_every == 0:
                self._write_checkpoint(self._checkpoint_dir)
        self.check_host_updates()

    def on_reset(self) -> None:
        """After Horovod re-initialised: learn the new ring epoch, then run reset callbacks."""
        runtime.refresh_ring_epoch()
        super().on_reset()
        size = hvd.size()
        if self._on_resize is not None and size != self._size:
            self._on_resize(self._size, size)
        self._size = size

    def sync(self) -> None:
        """Give every rank the newest committed state (from the lowest rank that has it)."""
        commits = allgather_object(self._saved_state.get("commit_id", 0))
        root = int(np.argmax(commits))
        broadcast_variables(self.model.variables, root_rank=root)
        broadcast_variables(self.optimizer.variables(), root_rank=root)
        self._save_model()
        self._saved_state = broadcast_object(self._saved_state, root_rank=root)
        self._set_attrs()

    # -- progress ------------------------------------------------------------------------------

    def _report(self) -> None:
        if not os.environ.get(env.JOB_ID) or not os.environ.get(env.ETCD_ENDPOINTS):
            return
        try:
            if self._reporter is None:
                from elastic_allreduce.store import EtcdStore  # noqa: PLC0415

                self._reporter = EtcdStore(os.environ[env.ETCD_ENDPOINTS], os.environ[env.JOB_ID])
            progress = {
                name: value
                for name, value in self._saved_state.items()
                if isinstance(value, (int, float, str, bool))
            }
            self._reporter.put("status/progress", {**progress, "size": hvd.size()})
        except ElasticAllreduceError as exc:
            log.warning("could not report progress to the store: %s", exc)

    # -- checkpoints ---------------------------------------------------------------------------

    def _arrays(self) -> list[Any]:
        return [*self.model.variables, *self.optimizer.variables()]

    def _write_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        attributes = dict(self._saved_state)
        try:
            attributes_json = json.dumps(attributes)
        except TypeError as exc:
            raise ConfigError(
                f"cannot checkpoint the state's attributes {sorted(attributes)}: {exc}; "
                "keep them JSON values (numbers, strings, lists, dicts)"
            ) from exc
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory))
        # Unique: a job that resumed from an older checkpoint may reach the same commit again.
        name = f"commit-{self.commit_id:09d}-{staging.name.rsplit('-', 1)[-1]}"
        arrays = {f"a{i}": np.asarray(v.numpy()) for i, v in enumerate(self._arrays())}
        np.savez(staging / "arrays.npz", **arrays)
        (staging / "state.json").write_text(attributes_json)
        os.replace(staging, directory / name)
        latest = directory / f".{_LATEST}.tmp"
        latest.write_text(name)
        os.replace(latest, directory / _LATEST)
        for old in directory.glob("commit-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)

    def _load_checkpoint(self, directory: Path) -> None:
        try:
            name = (directory / _LATEST).read_text().strip()
        except FileNotFoundError:
            return
        folder = directory / name
        attributes = json.loads((folder / "state.json").read_text())
        with np.load(folder / "arrays.npz") as stored:
            values = [stored[f"a{i}"] for i in range(len(stored.files))]
        variables = self._arrays()
        if len(values) != len(variables):
            raise ConfigError(
                f"checkpoint {folder} holds {len(values)} arrays but the model and optimizer "
                f"have {len(variables)} variables: a different model, or an optimizer that is "
                "not built yet (call optimizer.build(model.trainable_variables) first)"
            )
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)
        self._saved_state = attributes
        self._set_attrs()
        self.save()
        log.info("resumed from checkpoint %s (commit %s)", folder, attributes.get("commit_id"))


__all__ = [
    "Batch",
    "CommitStateCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "ElasticData",
    "ScaleLearningRate",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "allreduce",
    "init",
    "local_rank",
    "rank",
    "run",
    "shutdown",
    "size",
]
