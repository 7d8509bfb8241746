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
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.elastic import TensorFlowKerasState
from horovod.tensorflow.elastic import run as _horovod_run
from horovod.tensorflow.functions import allgather_object, broadcast_object, broadcast_variables
from horovod.tensorflow.keras.elastic import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)

from elastic_allreduce import env
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


class State(TensorFlowKerasState):  # type: ignore[misc]
    """Elastic training state of a Keras model and optimizer (see the module docstring).

    Extra keyword arguments become attributes that are committed, restored and synced with the
    model (for example ``step=0, epoch=0``); checkpoints need them to be JSON values.
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
    "CommitStateCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
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
