"""``python -m elastic_allreduce.zoo.run check|train [training flags]``: the built-in loop.

``elastic-run train`` runs ``check`` once before any worker starts (a definition that cannot
train fails there, with exit code 2 and one ``error:`` line), then starts every training process
with ``train``. The loop is a custom one on :class:`elastic_allreduce.State` and
:class:`elastic_allreduce.ElasticData` (so every sample of every data epoch is applied exactly
once whatever the resizes):

- each step trains on ``mean loss x local count x loss_scale`` (the averaged gradient is then
  the mean over the global batch; a rank with an empty share contributes zero), and sums the
  loss over the ranks for the report;
- commits every ``--commit-every`` steps, at each data epoch's end and after every evaluation;
- evaluates on ``--validation-data`` every ``--eval-every`` steps (or after every data epoch) and
  at the end: each rank runs its contiguous part of the records, and the metrics' state
  variables are summed over the ranks with one allreduce (right for every metric whose state is
  a sum: means, accuracies, counts, confusion matrices, AUC); the result is committed with the
  step, and a failure during an evaluation rolls back to the commit before it;
- rank 0 prints one JSON line per commit, evaluation and data epoch, and at the end exports the
  model to ``--output`` (:mod:`elastic_allreduce.zoo.export`).

Keras callbacks from ``callbacks()`` run on every rank, with ``on_train_batch_*``,
``on_epoch_*`` and ``on_train_*`` (steps re-run after a rollback are seen again); a callback that
sets ``model.stop_training`` (for example EarlyStopping) stops every rank at the next commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from elastic_allreduce import progress, runtime
from elastic_allreduce.errors import ConfigError
from elastic_allreduce.training.data import TFRecordSource
from elastic_allreduce.zoo.contract import ModelDef
from elastic_allreduce.zoo.loader import check_output_dir, expand_paths, import_model_def
from elastic_allreduce.zoo.options import TrainOptions, add_train_flags, from_args
from elastic_allreduce.zoo.pipeline import (
    LOSS,
    Pieces,
    RecordParser,
    build,
    learning_rate,
    learning_rate_is_schedule,
    make_pieces,
    parse_checked,
    read_records,
    sample_records,
)

#: Records of each data set that ``check`` (and each worker, to build the model) runs.
SAMPLE_RECORDS = 8
#: Entries of the ring history kept in the state (the oldest are dropped).
RING_HISTORY = 100


def _check_policy(definition: ModelDef, pieces: Pieces, options: TrainOptions) -> None:
    if options.policy == "linear" and learning_rate_is_schedule(pieces.optimizer):
        raise definition.error(
            "optimizer",
            "returned an optimizer with a LearningRateSchedule, but --batch-per-rank multiplies "
            "the learning rate by the number of ranks: use --global-batch, or move the schedule "
            "to learning_rate_schedule(step)",
        )


def check(options: TrainOptions) -> int:
    """Make every piece of the definition and run it once on the first records; print one
    JSON line with what was found. Trains nothing, writes nothing."""
    definition = import_model_def(options.model_def)
    train_files = expand_paths(options.training_data, "--training-data")
    valid_files = expand_paths(options.validation_data, "--validation-data")
    if options.output is not None:
        check_output_dir(options.output)
    pieces = make_pieces(definition)
    _check_policy(definition, pieces, options)
    source, records = sample_records(train_files, SAMPLE_RECORDS)
    report = build(pieces, definition, RecordParser(definition, "train"), records)
    found: dict[str, Any] = {"event": "checked", "training_records": len(source)}
    if valid_files:
        valid_source, valid_records = sample_records(valid_files, SAMPLE_RECORDS)
        features, _ = parse_checked(RecordParser(definition, "evaluate"), valid_records)
        try:
            pieces.model(features, training=False)
        except Exception as exc:
            raise definition.error(
                "dataset_fn",
                f"gives features in mode 'evaluate' that the model cannot take: "
                f"{type(exc).__name__}: {exc}",
            ) from exc
        found["validation_records"] = len(valid_source)
    scratch = Path(tempfile.mkdtemp(prefix="elastic-allreduce-check-"))
    try:
        pieces.model.save(scratch / "model.keras")
    except Exception as exc:
        raise definition.error(
            "custom_model",
            f"returned a model that cannot be saved as .keras ({type(exc).__name__}: {exc}): "
            "give custom layers get_config() and register them with "
            "tf.keras.utils.register_keras_serializable",
        ) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    found.update(
        features=report.features,
        labels=report.labels,
        predictions=report.predictions,
        parameters=report.parameters,
        initial_loss=round(report.loss, 6),
    )
    print(json.dumps(found), flush=True)
    return 0


def _metric_value(metric: tf.keras.metrics.Metric) -> Any:  # noqa: ANN401 - float or list
    value = np.asarray(metric.result())
    return round(float(value), 6) if value.ndim == 0 else np.round(value, 6).tolist()


class Trainer:
    """The elastic loop of one training process (see the module docstring)."""

    def __init__(self, options: TrainOptions) -> None:
        import horovod.tensorflow as hvd  # noqa: PLC0415 - only the train action needs it

        import elastic_allreduce as ea  # noqa: PLC0415

        self.hvd, self.ea = hvd, ea
        self.options = options
        ea.init()
        tf.keras.utils.set_random_seed(options.seed)
        self.definition = import_model_def(options.model_def)
        self.train_files = expand_paths(options.training_data, "--training-data")
        self.valid_files = expand_paths(options.validation_data, "--validation-data")
        self.pieces = make_pieces(self.definition)
        _check_policy(self.definition, self.pieces, options)
        parser = RecordParser(self.definition, "train")
        batching: dict[str, Any] = (
            {"global_batch": options.global_batch}
            if options.policy == "fixed"
            else {"batch_per_rank": options.batch_per_rank}
        )
        self.data = ea.ElasticData.from_tfrecords(
            self.train_files, parser, seed=options.seed, **batching
        )
        self.samples = len(self.data.source)
        # Every rank (a joiner too) must address the same records by the same ids.
        described = json.dumps([self.train_files, self.samples]).encode()
        self.data_signature = hashlib.sha256(described).hexdigest()[:16]
        first = read_records(self.data.source, np.arange(min(SAMPLE_RECORDS, self.samples)))
        build(self.pieces, self.definition, parser, first)
        self.model, self.optimizer = self.pieces.model, self.pieces.optimizer
        self.base_rate = float(np.asarray(self.optimizer.learning_rate))
        self.features_spec, labels_spec = parser.element_spec
        self.train_step = tf.function(
            self._train_step,
            input_signature=[self.features_spec, labels_spec, tf.TensorSpec((), tf.float32)],
        )
        self.valid: TFRecordSource | None = None
        if self.valid_files:
            self.valid = TFRecordSource(self.valid_files)
            eval_parser = RecordParser(self.definition, "evaluate")
            self.eval_parse = eval_parser.compiled()
            self.eval_step = tf.function(self._eval_step, input_signature=eval_parser.element_spec)
        self.loss_metric = tf.keras.metrics.Mean(name=LOSS)
        self.callbacks = tf.keras.callbacks.CallbackList(self.pieces.callbacks, model=self.model)
        self.model.stop_training = False
        self.state = ea.State(
            self.model,
            self.optimizer,
            epoch=0,
            position=0,
            step=0,
            loss_sum=0.0,
            loss_count=0.0,
            train_loss=None,
            evaluated_at=-1,
            metrics={},
            rings=[],
            data=self.data_signature,
            stopped=False,
        )

    # -- the steps (tf.functions) --------------------------------------------------------------

    def _train_step(self, features: Any, labels: Any, loss_scale: tf.Tensor) -> tf.Tensor:  # noqa: ANN401
        count = tf.cast(tf.shape(tf.nest.flatten(labels)[0])[0], tf.float32)
        with tf.GradientTape() as tape:

            def scaled() -> tuple[tf.Tensor, tf.Tensor]:
                predictions = self.model(features, training=True)
                mean = tf.cast(self.pieces.loss(labels, predictions), tf.float32)
                if self.model.losses:  # regularizers: added once to the global mean
                    mean += tf.cast(tf.add_n(self.model.losses), tf.float32)
                return mean * count * loss_scale, mean

            def empty() -> tuple[tf.Tensor, tf.Tensor]:
                return tf.constant(0.0), tf.constant(0.0)

            loss, mean = tf.cond(count > 0, scaled, empty)
        # Horovod's own code needs no AutoGraph conversion (converting it takes seconds).
        gradient = tf.autograph.experimental.do_not_convert(
            self.ea.DistributedGradientTape(tape).gradient
        )
        variables = self.model.trainable_variables
        gradients = gradient(loss, variables)
        self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
        allreduce = tf.autograph.experimental.do_not_convert(self.hvd.allreduce)
        return allreduce(tf.stack([mean * count, count]), op=self.hvd.Sum, name="zoo_train_loss")

    def _eval_step(self, features: Any, labels: Any) -> None:  # noqa: ANN401
        predictions = self.model(features, training=False)
        count = tf.shape(tf.nest.flatten(labels)[0])[0]

        def update_loss() -> tf.Tensor:
            mean = tf.cast(self.pieces.loss(labels, predictions), tf.float32)
            self.loss_metric.update_state(mean, sample_weight=tf.cast(count, tf.float32))
            return tf.constant(0)

        tf.cond(count > 0, update_loss, lambda: tf.constant(0))
        for metric in self.pieces.metrics.values():
            metric.update_state(labels, predictions)

    # -- the loop ------------------------------------------------------------------------------

    def _finished(self, state: Any) -> bool:  # noqa: ANN401 - ea.State
        steps = self.options.max_steps
        return bool(
            state.epoch >= self.options.epochs
            or (steps is not None and state.step >= steps)
            or state.stopped
        )

    def _print(self, record: dict[str, Any]) -> None:
        if self.hvd.rank() == 0:
            print(json.dumps(record), flush=True)

    def _note_ring(self, state: Any) -> None:  # noqa: ANN401
        entry = [runtime.ring_epoch(), self.hvd.size(), int(state.step)]
        if not state.rings or state.rings[-1][:2] != entry[:2]:
            state.rings = [*state.rings, entry][-RING_HISTORY:]  # a new list: commits keep refs

    def _set_learning_rate(self, state: Any) -> None:  # noqa: ANN401
        schedule = self.pieces.schedule
        if schedule is None and self.options.policy == "fixed":
            return
        rate = (
            self.base_rate
            if schedule is None
            else learning_rate(self.definition, schedule, int(state.step))
        )
        if self.options.policy == "linear":
            rate *= self.hvd.size()
        self.optimizer.learning_rate.assign(rate)

    def _commit(self, state: Any) -> None:  # noqa: ANN401
        if self.pieces.callbacks:  # a stop asked by a callback on any rank stops every rank
            asked = tf.constant([1.0 if self.model.stop_training else 0.0])
            if float(self.hvd.allreduce(asked, op=self.hvd.Max, name="zoo_stop")[0]) > 0:
                state.stopped = True
        state.commit()
        line = {
            "event": "commit",
            "step": int(state.step),
            "epoch": int(state.epoch),
            "size": self.hvd.size(),
            "rank": self.hvd.rank(),
        }
        if state.loss_count:  # the mean loss of the data epoch so far
            line["loss"] = round(state.loss_sum / state.loss_count, 6)
        self._print(line)

    def _evaluate(self, state: Any) -> None:  # noqa: ANN401
        with progress.phase("evaluation"):  # a long pass is not a hang
            self._evaluate_now(state)

    def _evaluate_now(self, state: Any) -> None:  # noqa: ANN401
        assert self.valid is not None
        ids = np.array_split(np.arange(len(self.valid)), self.hvd.size())[self.hvd.rank()]
        metrics = [self.loss_metric, *self.pieces.metrics.values()]
        for metric in metrics:
            metric.reset_state()
        batch = self.options.eval_batch
        for start in range(0, max(len(ids), 1), batch):  # an empty part still updates once
            features, labels = self.eval_parse(read_records(self.valid, ids[start : start + batch]))
            self.eval_step(features, labels)
        variables = [v for metric in metrics for v in metric.variables]
        flat = tf.concat([tf.reshape(tf.cast(v, tf.float64), [-1]) for v in variables], 0)
        total = self.hvd.allreduce(flat, op=self.hvd.Sum, name="zoo_evaluate")
        offset = 0
        for variable in variables:
            size = int(np.prod(variable.shape))
            part = tf.reshape(total[offset : offset + size], variable.shape)
            variable.assign(tf.cast(part, variable.dtype))
            offset += size
        names = [LOSS, *self.pieces.metrics]
        state.metrics = {name: _metric_value(m) for name, m in zip(names, metrics, strict=True)}
        state.evaluated_at = int(state.step)
        self._print(
            {
                "event": "evaluate",
                "step": int(state.step),
                "epoch": int(state.epoch),
                "size": self.hvd.size(),
                "metrics": state.metrics,
            }
        )

    def _end_epoch(self, state: Any) -> None:  # noqa: ANN401
        """Next data epoch; evaluate (unless --eval-every), callbacks, then commit all of it."""
        completed = int(state.epoch)
        state.train_loss = state.loss_sum / state.loss_count if state.loss_count else None
        state.loss_sum, state.loss_count = 0.0, 0.0
        self.data.next_epoch(state)
        self._print(
            {
                "event": "epoch",
                "epoch": completed,
                "step": int(state.step),
                "loss": state.train_loss,
            }
        )
        logs: dict[str, Any] = {LOSS: state.train_loss}
        if self.valid is not None and self.options.eval_every is None:
            self._evaluate(state)
            logs.update({f"val_{k}": v for k, v in state.metrics.items()})
        self.callbacks.on_epoch_end(completed, logs)
        self._commit(state)

    def _loop(self, state: Any) -> None:  # noqa: ANN401
        """The function under ``ea.run``: from the committed state to the end.

        An evaluation runs *before* the commit that follows it, so its result is committed with
        the step (a resize announced at that commit cannot skip it) and a failure during it
        rolls back to the commit before, after which the steps and the evaluation run again.
        """
        if state.data != self.data_signature:
            raise ConfigError(
                f"this process sees {self.samples} training records in {len(self.train_files)} "
                "files, not the data the job trains on (files added, removed or changed while "
                "it runs?): every process must read the same --training-data"
            )
        self._note_ring(state)
        every = self.options.eval_every
        while not self._finished(state):
            if state.position == 0:
                self.callbacks.on_epoch_begin(int(state.epoch))
            for batch in self.data.batches(state):
                self._set_learning_rate(state)
                self.callbacks.on_train_batch_begin(int(state.step))
                totals = self.train_step(
                    batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32)
                ).numpy()
                step_loss = float(totals[0] / totals[1]) if totals[1] else 0.0
                self.data.advance(state, batch, metrics={LOSS: step_loss})
                state.loss_sum += float(totals[0])
                state.loss_count += float(totals[1])
                self.callbacks.on_train_batch_end(int(state.step) - 1, {LOSS: step_loss})
                evaluate = self.valid is not None and every is not None and state.step % every == 0
                if evaluate:
                    self._evaluate(state)
                if evaluate or self._finished(state) or state.step % self.options.commit_every == 0:
                    self._commit(state)
                if self._finished(state):
                    break
            else:
                self._end_epoch(state)
        if self.valid is not None and state.evaluated_at != state.step:
            self._evaluate(state)  # after the last commit: a failure here re-runs only this

    def run(self) -> dict[str, Any]:
        """Train to the end; the summary of the run (the same on every rank)."""
        started = time.monotonic()
        self.callbacks.on_train_begin()
        self.ea.run(self._loop)(self.state)
        self.callbacks.on_train_end()
        state = self.state
        train_loss = state.loss_sum / state.loss_count if state.loss_count else state.train_loss
        return {
            "model_def": self.options.model_def,
            "training_data": self.train_files,
            "validation_data": self.valid_files,
            "samples_per_epoch": self.samples,
            "steps": int(state.step),
            "epochs": round(int(state.epoch) + int(state.position) / self.samples, 4),
            "global_batch": self.options.global_batch,
            "batch_per_rank": self.options.batch_per_rank,
            "train_loss": None if train_loss is None else round(train_loss, 6),
            "final_metrics": state.metrics,
            "stopped_by_callback": bool(state.stopped),
            "rings": [{"ring": r, "ranks": n, "from_step": s} for r, n, s in state.rings],
            "seconds_on_this_rank": round(time.monotonic() - started, 1),
        }


def train(options: TrainOptions) -> int:
    """Train; rank 0 prints the final metrics and exports the model."""
    trainer = Trainer(options)
    summary = trainer.run()
    if trainer.hvd.rank() != 0:
        return 0
    print(json.dumps({"event": "done", **summary}), flush=True)
    shown = ", ".join(f"{k} {v}" for k, v in summary["final_metrics"].items()) or "none"
    print(f"final metrics: {shown} (train loss {summary['train_loss']})", flush=True)
    if options.output is not None:
        from elastic_allreduce.zoo.export import export  # noqa: PLC0415

        folder = export(
            trainer.model,
            trainer.features_spec,
            options.output,
            summary,
            trainer.definition.source_file,
        )
        print(f"exported the model to {folder}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit code 2 with one ``error:`` line for bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_allreduce.zoo.run",
        description="Check a model definition, or train it elastically (elastic-run train).",
    )
    parser.add_argument("action", choices=("check", "train"), help="check only, or train")
    add_train_flags(parser)
    args = parser.parse_args(argv)
    try:
        options = from_args(args)
        return check(options) if args.action == "check" else train(options)
    except ConfigError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    # Only a failure leaves through sys.exit: elastic-run's bootstrap reports a training
    # process as finished when its script returns, not when it raises SystemExit (even 0).
    code = main()
    if code:
        sys.exit(code)
