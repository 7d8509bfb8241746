"""Batch prediction with a model that ``elastic-run train --output DIR`` exported (one process).

The records go through the definition's ``dataset_fn(dataset, "predict")`` (from ``DIR/
model_def.py`` unless another definition is given) and the model of ``DIR/model.keras`` (or of
``DIR/saved_model/``). Predictions are written one JSON line per record (``{"index": i,
"prediction": ...}``) or, to a ``.npy`` file, as one array. When ``dataset_fn`` gives
``(features, labels)`` pairs in ``predict`` mode, the loss and the definition's metrics over all
records are reported as well.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.training.data import TFRecordSource
from elastic_allreduce.zoo.export import KERAS_FILE, MODEL_DEF_FILE, SAVED_MODEL, read_summary
from elastic_allreduce.zoo.loader import expand_paths, import_model_def
from elastic_allreduce.zoo.pipeline import LOSS, RecordParser, call, parse_checked, read_records


@dataclass(frozen=True)
class Prediction:
    """What a prediction run did."""

    records: int
    files: int
    #: Loss and metrics over every record, when the data carries labels.
    metrics: dict[str, Any] = field(default_factory=dict)


def _model_def(folder: Path, model_def: str | None) -> str:
    if model_def is not None:
        return model_def
    if (folder / MODEL_DEF_FILE).is_file():
        return str(folder / MODEL_DEF_FILE)
    stored = read_summary(folder).get("model_def")
    if not isinstance(stored, str):
        raise ConfigError(f"{folder} names no model definition: pass --model-def")
    return stored


def _load(folder: Path, saved_model: bool) -> Callable[[Any], Any]:
    if saved_model:
        path = folder / SAVED_MODEL
        if not path.is_dir():
            raise ConfigError(f"--model-dir {folder} has no {SAVED_MODEL}/")
        loaded = tf.saved_model.load(str(path))  # kept: its variables die with it
        return lambda features: loaded.serve(features)  # noqa: PLW0108 - keeps it alive
    path = folder / KERAS_FILE
    if not path.is_file():
        raise ConfigError(
            f"--model-dir {folder} has no {KERAS_FILE}: give the --output folder of "
            "`elastic-run train`"
        )
    model = tf.keras.models.load_model(str(path), compile=False)
    return lambda features: model(features, training=False)


def _rows(predictions: Any) -> list[Any]:  # noqa: ANN401 - a nest of tensors
    """One JSON value per record of a batch of predictions (a nest becomes a dict or list)."""
    nest = tf.nest.map_structure(lambda t: np.asarray(t).tolist(), predictions)
    if isinstance(nest, dict):
        count = len(next(iter(nest.values())))
        return [{k: v[i] for k, v in nest.items()} for i in range(count)]
    if isinstance(nest, tuple):
        return [list(row) for row in zip(*nest, strict=True)]
    return list(nest)


class _Writer:
    """Predictions as JSON lines to a stream or file, or as one array to a ``.npy`` file."""

    def __init__(self, output: IO[str] | str | None) -> None:
        self.path = output if isinstance(output, str) else None
        self.numpy = self.path is not None and self.path.endswith(".npy")
        self.arrays: list[npt.NDArray[Any]] = []
        self.stream: IO[str] | None = None if isinstance(output, str) else output
        if self.path is not None and not self.numpy:
            self.stream = open(self.path, "w")  # noqa: SIM115 - closed by close()

    def write(self, first: int, predictions: Any) -> None:  # noqa: ANN401 - a nest of tensors
        if self.numpy:
            if not isinstance(predictions, tf.Tensor | np.ndarray):
                raise ConfigError("the model gives several outputs: write JSON lines, not .npy")
            self.arrays.append(np.asarray(predictions))
        elif self.stream is not None:
            for offset, row in enumerate(_rows(predictions)):
                self.stream.write(json.dumps({"index": first + offset, "prediction": row}) + "\n")

    def close(self) -> None:
        if self.numpy and self.path is not None:
            np.save(self.path, np.concatenate(self.arrays) if self.arrays else np.zeros((0,)))
        elif self.path is not None and self.stream is not None:
            self.stream.close()


def predict(
    model_dir: str,
    data: Sequence[str],
    *,
    model_def: str | None = None,
    output: IO[str] | str | None = None,
    batch: int = 256,
    saved_model: bool = False,
) -> Prediction:
    """Predict every record of ``data`` (TFRecord files or patterns) with the model of
    ``model_dir``; write the predictions to ``output`` (a stream for JSON lines, or a path:
    ``.npy`` for one array, anything else for JSON lines)."""
    if batch < 1:
        raise ConfigError(f"--batch must be at least 1, got {batch}")
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ConfigError(f"--model-dir {model_dir} is not a folder")
    definition = import_model_def(_model_def(folder, model_def))
    files = expand_paths(data, "--data")
    parser = RecordParser(definition, "predict")
    model = _load(folder, saved_model)
    metrics: dict[str, tf.keras.metrics.Metric] = {}
    if parser.pairs:
        metrics[LOSS] = tf.keras.metrics.Mean(name=LOSS)
        if definition.eval_metrics_fn is not None:
            metrics.update(call(definition, "eval_metrics_fn"))
    source = TFRecordSource(files)
    writer = _Writer(output)
    try:
        for start in range(0, len(source), batch):
            ids = np.arange(start, min(start + batch, len(source)), dtype=np.int64)
            parsed = parse_checked(parser, read_records(source, ids))
            features, labels = parsed if parser.pairs else (parsed, None)
            predictions = model(features)
            if labels is not None:
                for name, metric in metrics.items():
                    if name == LOSS:
                        value = call(definition, "loss", labels, predictions)
                        metric.update_state(value, sample_weight=len(ids))
                    else:
                        metric.update_state(labels, predictions)
            writer.write(start, predictions)
    finally:
        writer.close()
    results = {}
    for name, metric in metrics.items():
        value = np.asarray(metric.result())
        results[name] = round(float(value), 6) if value.ndim == 0 else value.tolist()
    return Prediction(records=len(source), files=len(files), metrics=results)
