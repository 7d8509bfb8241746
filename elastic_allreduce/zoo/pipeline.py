"""A model definition's pieces, made and checked with TensorFlow (no Horovod).

:func:`make_pieces` calls ``custom_model``, ``optimizer``, ``eval_metrics_fn`` and ``callbacks``
and checks what they return; :class:`RecordParser` turns a batch of serialized records into
``(features, labels)`` through ``dataset_fn`` (the ``parse`` of
:meth:`elastic_allreduce.ElasticData.from_tfrecords`); :func:`build` runs the model, the loss and
the metrics once on real records, so that a definition that cannot train fails before any
worker starts (``elastic-run train`` runs it through ``python -m elastic_allreduce.zoo.run
check``). Every failure is a ConfigError naming the definition and the function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.training.data import Source, TFRecordSource
from elastic_allreduce.zoo.contract import ModelDef, UserFunction, check_mode

#: The name under which the loss is reported next to the definition's metrics.
LOSS = "loss"


def call(definition: ModelDef, name: str, *args: object) -> Any:  # noqa: ANN401 - user code
    """Call the definition's ``name``; an exception it raises becomes a ConfigError naming it."""
    function = getattr(definition, name)
    try:
        return function(*args)
    except ConfigError:
        raise
    except Exception as exc:
        raise definition.error(name, f"raised {type(exc).__name__}: {exc}") from exc


@dataclass
class Pieces:
    """What a definition's functions returned, checked."""

    model: tf.keras.Model
    loss: UserFunction
    optimizer: tf.keras.optimizers.Optimizer
    metrics: dict[str, tf.keras.metrics.Metric]
    callbacks: list[tf.keras.callbacks.Callback]
    schedule: UserFunction | None


def make_pieces(definition: ModelDef) -> Pieces:
    """Call the definition's constructors and check their results."""
    model = call(definition, "custom_model")
    if not isinstance(model, tf.keras.Model):
        raise definition.error(
            "custom_model", f"returned a {type(model).__name__}, not a tf.keras.Model"
        )
    optimizer = call(definition, "optimizer")
    if not isinstance(optimizer, tf.keras.optimizers.Optimizer):
        hint = (
            " (a legacy optimizer: use tf.keras.optimizers.X, not tf.keras.optimizers.legacy.X)"
            # By its module: Keras 3 has no tf.keras.optimizers.legacy to compare with.
            if ".optimizers.legacy." in type(optimizer).__module__
            else ""
        )
        raise definition.error(
            "optimizer",
            f"returned a {type(optimizer).__name__}, not a tf.keras.optimizers.Optimizer{hint}",
        )
    metrics: dict[str, tf.keras.metrics.Metric] = {}
    if definition.eval_metrics_fn is not None:
        found = call(definition, "eval_metrics_fn")
        if not isinstance(found, dict):
            raise definition.error(
                "eval_metrics_fn", f"returned a {type(found).__name__}, not a dict name -> metric"
            )
        for name, metric in found.items():
            if not isinstance(name, str) or not name or name == LOSS:
                raise definition.error(
                    "eval_metrics_fn",
                    f"returned the key {name!r}: names are non-empty strings other than {LOSS!r} "
                    "(the loss is always reported)",
                )
            if not isinstance(metric, tf.keras.metrics.Metric):
                raise definition.error(
                    "eval_metrics_fn",
                    f"returned {type(metric).__name__} for {name!r}, not a tf.keras.metrics.Metric",
                )
        metrics = dict(found)
    callbacks: list[tf.keras.callbacks.Callback] = []
    if definition.callbacks is not None:
        found = call(definition, "callbacks")
        if not isinstance(found, list | tuple) or not all(
            isinstance(c, tf.keras.callbacks.Callback) for c in found
        ):
            raise definition.error(
                "callbacks", f"returned {found!r}, not a list of tf.keras.callbacks.Callback"
            )
        callbacks = list(found)
    return Pieces(
        model, definition.loss, optimizer, metrics, callbacks, definition.learning_rate_schedule
    )


def learning_rate_is_schedule(optimizer: tf.keras.optimizers.Optimizer) -> bool:
    """Whether the optimizer was made with a LearningRateSchedule (its rate cannot be set)."""
    rate = getattr(optimizer, "_learning_rate", None)
    return isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule)


def describe(structure: Any) -> str:  # noqa: ANN401 - any nest of specs
    """A nest of TensorSpecs as short text: ``(float32[?,8,8,1], int64[?])``."""
    if isinstance(structure, tf.TensorSpec):
        dims = ",".join("?" if d is None else str(d) for d in structure.shape.as_list())
        return f"{structure.dtype.name}[{dims}]"
    if isinstance(structure, dict):
        inner = ", ".join(f"{k!r}: {describe(v)}" for k, v in structure.items())
        return "{" + inner + "}"
    if isinstance(structure, tuple | list):
        return "(" + ", ".join(describe(v) for v in structure) + ")"
    return type(structure).__name__


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
    """An empty batch of ``spec`` (unknown inner sizes taken as 0)."""
    dims = [0 if d is None else d for d in spec.shape.as_list()]
    return tf.zeros([0, *dims[1:]], spec.dtype)


class RecordParser:
    """A batch of serialized records -> ``(features, labels)`` through ``dataset_fn``.

    ``dataset_fn`` sees a dataset of the batch's records, one scalar string each, and must
    return one element per record (a ``map``: no filter, batch, shuffle or repeat); the parser
    batches the result back, checks the count, and returns an empty batch for no records.
    In ``predict`` mode the elements may be features alone (``pairs`` is then False).
    """

    def __init__(self, definition: ModelDef, mode: str) -> None:
        self.definition = definition
        self.mode = check_mode(mode)
        self._compiled: Any = None
        probe = self._mapped(tf.data.Dataset.from_tensor_slices(tf.constant([], tf.string)))
        spec = probe.element_spec
        self.pairs = isinstance(spec, tuple) and len(spec) == 2
        if not self.pairs and mode != "predict":
            raise definition.error(
                "dataset_fn",
                f"must give (features, labels) pairs in mode {mode!r}; it gives elements "
                f"{describe(spec)}",
            )
        #: The batched structure (batch dimension unknown) that ``__call__`` returns.
        self.element_spec = tf.nest.map_structure(
            lambda s: tf.TensorSpec([None, *s.shape.as_list()], s.dtype), spec
        )

    def _mapped(self, records: tf.data.Dataset) -> tf.data.Dataset:
        dataset = call(self.definition, "dataset_fn", records, self.mode)
        if not isinstance(dataset, tf.data.Dataset):
            raise self.definition.error(
                "dataset_fn", f"returned a {type(dataset).__name__}, not a tf.data.Dataset"
            )
        return dataset

    def __call__(self, serialized: tf.Tensor) -> Any:  # noqa: ANN401 - the definition's nest
        count = tf.shape(serialized)[0]
        mapped = self._mapped(tf.data.Dataset.from_tensor_slices(serialized))
        batched = mapped.batch(tf.cast(tf.maximum(count, 1), tf.int64))
        empty = tf.data.Dataset.from_tensors(tf.nest.map_structure(_zeros, self.element_spec))
        result = batched.concatenate(empty).take(1).get_single_element()
        first = tf.nest.flatten(result)[0]
        check = tf.debugging.assert_equal(
            tf.shape(first)[0],
            count,
            message=(
                f"model definition {self.definition.label}: dataset_fn(dataset, mode) must give "
                "exactly one element per record (map only: no filter, batch or repeat)"
            ),
        )
        with tf.control_dependencies([check]):
            return tf.nest.map_structure(tf.identity, result)

    def compiled(self) -> Any:  # noqa: ANN401 - a tf.function
        """The parser as a tf.function of a string vector (for evaluation and prediction)."""
        if self._compiled is None:
            self._compiled = tf.function(self, input_signature=[tf.TensorSpec([None], tf.string)])
        return self._compiled


def read_records(source: Source, ids: npt.NDArray[np.int64]) -> tf.Tensor:
    """The serialized records ``ids`` of ``source`` as a string vector."""
    (raw,) = source.fetch(ids)
    return tf.constant(raw.tolist(), dtype=tf.string, shape=[len(raw)])


def sample_records(paths: Sequence[str], count: int) -> tuple[TFRecordSource, tf.Tensor]:
    """The source of ``paths`` and its first ``count`` records (fewer if it has fewer)."""
    source = TFRecordSource(paths)
    return source, read_records(source, np.arange(min(count, len(source)), dtype=np.int64))


def parse_checked(parser: RecordParser, records: tf.Tensor) -> Any:  # noqa: ANN401
    """``parser(records)``, with TensorFlow's errors turned into a ConfigError."""
    try:
        return parser.compiled()(records)
    except ConfigError:
        raise
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise parser.definition.error(
            "dataset_fn", f"failed on the first records in mode {parser.mode!r}: {message}"
        ) from exc


@dataclass(frozen=True)
class BuildReport:
    """What :func:`build` found, for the check's output."""

    features: str
    labels: str
    predictions: str
    parameters: int
    loss: float


def build(
    pieces: Pieces, definition: ModelDef, parser: RecordParser, records: tf.Tensor
) -> BuildReport:
    """Run the model, the loss and the metrics once on ``records`` (which builds the model and
    the optimizer), checking each; the metrics are reset afterwards."""
    features, labels = parse_checked(parser, records)
    try:
        predictions = pieces.model(features, training=False)
    except Exception as exc:
        raise definition.error(
            "custom_model",
            f"returned a model that cannot take the features of dataset_fn "
            f"{describe(parser.element_spec[0])}: {type(exc).__name__}: {exc}",
        ) from exc
    value = call(definition, "loss", labels, predictions)
    if not isinstance(value, tf.Tensor | np.ndarray | float):
        raise definition.error("loss", f"returned a {type(value).__name__}, not a scalar tensor")
    value = tf.convert_to_tensor(value)
    if value.shape.rank != 0 or not value.dtype.is_floating:
        raise definition.error(
            "loss",
            f"must return a scalar float tensor (the mean over the batch); it returned "
            f"{value.dtype.name} of shape {value.shape.as_list()}",
        )
    pieces.optimizer.build(pieces.model.trainable_variables)
    for name, metric in pieces.metrics.items():
        try:
            metric.update_state(labels, predictions)
        except Exception as exc:
            raise definition.error(
                "eval_metrics_fn",
                f"gave the metric {name!r}, which cannot take (labels, predictions): "
                f"{type(exc).__name__}: {exc}",
            ) from exc
        metric.reset_state()
    if pieces.schedule is not None:
        rate = learning_rate(definition, pieces.schedule, 0)
        if learning_rate_is_schedule(pieces.optimizer):
            raise definition.error(
                "learning_rate_schedule",
                f"is given, but optimizer() already has a LearningRateSchedule (rate {rate}): "
                "use one of the two",
            )
    return BuildReport(
        features=describe(parser.element_spec[0]),
        labels=describe(parser.element_spec[1]),
        predictions=describe(
            tf.nest.map_structure(
                lambda t: tf.TensorSpec([None, *t.shape.as_list()[1:]], t.dtype), predictions
            )
        ),
        parameters=int(sum(np.prod(v.shape) for v in pieces.model.trainable_variables)),
        loss=float(value.numpy()),
    )


def learning_rate(definition: ModelDef, schedule: UserFunction, step: int) -> float:
    """``learning_rate_schedule(step)`` as a float; ConfigError unless a finite number >= 0."""
    try:
        value = schedule(step)
        rate = float(value.numpy() if hasattr(value, "numpy") else value)
    except ConfigError:
        raise
    except Exception as exc:
        raise definition.error(
            "learning_rate_schedule", f"failed for step {step}: {type(exc).__name__}: {exc}"
        ) from exc
    if not math.isfinite(rate) or rate < 0:
        raise definition.error(
            "learning_rate_schedule", f"returned {rate} for step {step}: a rate is a number >= 0"
        )
    return rate
