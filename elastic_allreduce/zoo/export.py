"""The trained model, exported by rank 0 of ``elastic-run train --output DIR``.

``DIR/model.keras`` (``tf.keras.models.load_model``), ``DIR/saved_model/`` (a SavedModel with a
``serve`` endpoint whose batch dimension is free), ``DIR/summary.json`` (steps, epochs, final
metrics by name, the ring history) and ``DIR/model_def.py`` (a copy of the definition, which
``elastic-run predict`` imports for ``dataset_fn`` and any custom layers). Everything is written
to a staging folder next to ``DIR`` and renamed into place: a folder that is not empty is never
written into.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

import tensorflow as tf

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.zoo.loader import check_output_dir

KERAS_FILE: Final = "model.keras"
SAVED_MODEL: Final = "saved_model"
SUMMARY_FILE: Final = "summary.json"
MODEL_DEF_FILE: Final = "model_def.py"
_NOISY: Final = ("absl", "tensorflow")


def export(
    model: tf.keras.Model,
    features_spec: Any,  # noqa: ANN401 - a nest of TensorSpecs
    output: str,
    summary: dict[str, Any],
    model_def_source: str | None,
) -> Path:
    """Write the model, the SavedModel, the summary and the definition to ``output``."""
    target = Path(output).absolute()
    check_output_dir(str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    # The SavedModel writer logs (through absl) a line per batch of captured variables.
    loggers = [(logger, logger.level) for logger in map(logging.getLogger, _NOISY)]
    for logger, _ in loggers:
        logger.setLevel(logging.WARNING)
    try:
        model.save(staging / KERAS_FILE)
        archive = tf.keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint(
            "serve",
            tf.function(lambda features: model(features, training=False)),
            input_signature=[features_spec],
        )
        with contextlib.redirect_stdout(io.StringIO()):  # it lists the endpoints on stdout
            archive.write_out(str(staging / SAVED_MODEL))
        if model_def_source is not None and model_def_source.endswith(".py"):
            shutil.copy2(model_def_source, staging / MODEL_DEF_FILE)
        (staging / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        for logger, level in loggers:
            logger.setLevel(level)
    try:
        if target.exists():
            target.rmdir()  # empty (checked above); fails if something appeared meanwhile
        os.rename(staging, target)
    except OSError as exc:
        raise ConfigError(
            f"--output {target} was written to while training ({exc}); nothing was overwritten: "
            f"the export is in {staging}"
        ) from exc
    return target


def read_summary(folder: Path) -> dict[str, Any]:
    """``summary.json`` of an exported model (ConfigError if the folder is not one)."""
    try:
        summary = json.loads((folder / SUMMARY_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{folder} is not a model exported by `elastic-run train --output` (no readable "
            f"{SUMMARY_FILE}: {exc})"
        ) from exc
    if not isinstance(summary, dict):
        raise ConfigError(f"{folder / SUMMARY_FILE} is not a JSON object")
    return summary
