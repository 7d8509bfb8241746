"""``elastic-run train`` and ``elastic-run predict``: the model-zoo interface's command line.

``train`` checks its flags, the data files and the output folder, then checks the model
definition in a separate process (``python -m elastic_allreduce.zoo.run check``: it imports
TensorFlow and the user's code, which this long-lived launcher process should not hold), and
only then starts the job through ``elastic-run run``'s own code path, with the training command
``python -m elastic_allreduce.zoo.run train`` and the same flags. ``predict`` runs in this
process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Final, NoReturn

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.zoo import options as train_flags
from elastic_allreduce.zoo.loader import check_output_dir, expand_paths, is_file_spec
from elastic_allreduce.zoo.options import TrainOptions
from launcher import job_options
from launcher.job_options import JobOptions

#: The module every training process of `elastic-run train` runs.
RUNNER: Final = "elastic_allreduce.zoo.run"
#: Seconds the definition check may take (it imports TensorFlow and builds the model).
CHECK_TIMEOUT: Final = 600.0

_TRAIN_DESCRIPTION = """\
Train a model definition with the built-in elastic loop, without writing a training script.
The definition (--model-def: a .py file or an importable module) defines custom_model(),
loss(labels, predictions), optimizer() and dataset_fn(dataset, mode), and may define
eval_metrics_fn(), callbacks() and learning_rate_schedule(step) (docs/model-zoo.md).

Before any worker starts, the definition is imported and run once on the first records (in a
separate process); anything missing or wrongly typed is one error line and exit code 2. The job
then runs like `elastic-run run`: every sample is used exactly once per data epoch whatever the
joins, leaves and crashes; each rank evaluates its part of --validation-data and the metrics are
combined with an allreduce; rank 0 prints one JSON line per commit, evaluation and epoch, and
exports the model to --output.
"""

_PREDICT_DESCRIPTION = """\
Predict TFRecord records with a model exported by `elastic-run train --output DIR`, in this
process. Records go through dataset_fn(dataset, "predict") of DIR/model_def.py (or --model-def)
and the model of DIR/model.keras (or DIR/saved_model/ with --saved-model). Predictions are
written as JSON lines ({"index": i, "prediction": ...}) to --output or stdout (a .npy --output
gets one array); when dataset_fn gives (features, labels) pairs, the loss and the definition's
metrics over all records are printed on stderr.
"""


def add_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
    add_job_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Register ``train`` (with the training flags and ``add_job_flags``: the local job flags
    of ``elastic-run run``) and ``predict``."""
    train = commands.add_parser(
        "train",
        parents=list(parents),
        help="train a model definition (--model-def) with the built-in elastic loop",
        description=_TRAIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_flags.add_train_flags(train)
    add_job_flags(train)
    train.set_defaults(
        kubernetes=False, worker_template=None, namespace=None, kube_api=None, command_args=[]
    )
    predict = commands.add_parser(
        "predict",
        parents=list(parents),
        help="predict records with a model exported by `elastic-run train`",
        description=_PREDICT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    predict.add_argument(
        "--model-dir", required=True, metavar="DIR", help="the --output folder of a training"
    )
    predict.add_argument(
        "--data",
        required=True,
        metavar="PATHS",
        help="TFRecord files or glob patterns, comma-separated",
    )
    predict.add_argument(
        "--model-def", metavar="M", help="the model definition (default: DIR/model_def.py)"
    )
    predict.add_argument(
        "--output",
        metavar="FILE",
        help="write the predictions here: JSON lines, or one array for FILE.npy (default: stdout)",
    )
    predict.add_argument(
        "--batch", type=int, default=256, metavar="N", help="records per batch (default 256)"
    )
    predict.add_argument(
        "--saved-model",
        action="store_true",
        help="predict with DIR/saved_model/ instead of DIR/model.keras",
    )


def resolve(options: TrainOptions) -> TrainOptions:
    """The options with every path absolute and every data pattern expanded to its files (so
    that all training processes, joiners included, read the same files in the same order);
    ConfigError for missing data or an output folder that is not empty."""
    model_def = options.model_def
    if is_file_spec(model_def):
        if not os.path.isfile(model_def):
            raise ConfigError(f"model definition {model_def}: no such file")
        model_def = os.path.abspath(model_def)
    output = options.output
    if output is not None:
        check_output_dir(output)
        output = os.path.abspath(output)
    return replace(
        options,
        model_def=model_def,
        training_data=tuple(expand_paths(options.training_data, "--training-data")),
        validation_data=tuple(expand_paths(options.validation_data, "--validation-data")),
        output=output,
    )


def run_check(options: TrainOptions, timeout: float = CHECK_TIMEOUT) -> dict[str, Any]:
    """Run ``python -m elastic_allreduce.zoo.run check`` on ``options``: what it found, or the
    ConfigError it reported (its ``error:`` line)."""
    command = [sys.executable, "-m", RUNNER, "check", *train_flags.to_args(options)]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(
            f"checking the model definition {options.model_def} took more than {timeout:.0f} s"
        ) from exc
    errors = [
        line[len("error: ") :] for line in result.stderr.splitlines() if line.startswith("error: ")
    ]
    if result.returncode != 0:
        if errors:
            raise ConfigError(errors[-1])
        tail = " | ".join(result.stderr.strip().splitlines()[-5:])
        raise ConfigError(
            f"checking the model definition {options.model_def} failed with exit code "
            f"{result.returncode}: {tail}"
        )
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            found = json.loads(line)
            if isinstance(found, dict) and found.get("event") == "checked":
                return found
    raise ConfigError(f"checking the model definition {options.model_def} printed no result")


class _TrainCommandParser(argparse.ArgumentParser):
    """Unknown or missing flags are a ConfigError (one error line), not argparse's usage text
    and exit (which ``exit_on_error=False`` does not cover for them)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"the training command `train ...`: {message}")


def in_cluster(job: JobOptions) -> JobOptions:
    """A job for ``elastic-run k8s render|submit`` and ``run --kubernetes``: a training command
    ``train FLAGS`` (the training flags of ``elastic-run train``) becomes the runner's command;
    paths are the pods' (the definition inside the image, the data on a volume), so nothing is
    checked here beyond the flags: each training process checks the definition when it
    starts."""
    if job.command[:1] != ("train",):
        return job
    parser = _TrainCommandParser(prog="train", add_help=False, exit_on_error=False)
    train_flags.add_train_flags(parser)
    try:
        args = parser.parse_args(list(job.command[1:]))
    except argparse.ArgumentError as exc:
        raise ConfigError(f"the training command `train ...`: {exc}") from exc
    options = train_flags.from_args(args)
    command = ("python", "-m", RUNNER, "train", *train_flags.to_args(options))
    return job_options.validate(replace(job, command=command))


def run_train(args: argparse.Namespace, run_job: Callable[[argparse.Namespace], int]) -> int:
    """``elastic-run train``: check everything, then run the job with ``run_job`` (the code
    path of ``elastic-run run``)."""
    options = resolve(train_flags.from_args(args))
    args.command_args = ["--", "python", "-m", RUNNER, "train", *train_flags.to_args(options)]
    job_options.from_args(args)  # the job flags, checked before the slow definition check
    print(f"elastic-run train: checking {options.model_def} on the first records", flush=True)
    found = run_check(options)
    records = f"{found['training_records']} training records"
    if "validation_records" in found:
        records += f", {found['validation_records']} validation records"
    print(
        f"elastic-run train: {found['parameters']:,} parameters; features {found['features']}, "
        f"labels {found['labels']}, predictions {found['predictions']}; {records}",
        flush=True,
    )
    return run_job(args)


def run_predict(args: argparse.Namespace) -> int:
    """``elastic-run predict``: predictions to --output or stdout, the summary to stderr."""
    from elastic_allreduce.zoo.predict import predict  # noqa: PLC0415 - imports TensorFlow

    result = predict(
        args.model_dir,
        train_flags.split_paths(args.data),
        model_def=args.model_def,
        output=args.output or sys.stdout,
        batch=args.batch,
        saved_model=args.saved_model,
    )
    metrics = ", ".join(f"{k} {v}" for k, v in result.metrics.items())
    print(
        f"elastic-run predict: {result.records} records from {result.files} files"
        + (f"; {metrics}" if metrics else ""),
        file=sys.stderr,
        flush=True,
    )
    return 0
