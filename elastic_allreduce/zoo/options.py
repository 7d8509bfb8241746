"""The training flags of ``elastic-run train``, defined once.

The CLI (``elastic-run train``) parses and checks them, then starts every training process with
``python -m elastic_allreduce.zoo.run train`` and the same flags (:func:`to_args` writes flags
that :func:`from_args` reads back as the same options). Pure: no I/O.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from elastic_allreduce.errors import ConfigError

#: The global batch when neither --global-batch nor --batch-per-rank is given.
DEFAULT_GLOBAL_BATCH: Final = 64
DEFAULT_EPOCHS: Final = 1
DEFAULT_COMMIT_EVERY: Final = 10
DEFAULT_EVAL_BATCH: Final = 256

#: Title of the argument group of the training flags in --help.
GROUP_TITLE: Final = "training options"


@dataclass(frozen=True)
class TrainOptions:
    """What ``elastic-run train`` was asked to do (defaults resolved; see the flags' help)."""

    model_def: str
    #: TFRecord files or glob patterns, in the order given.
    training_data: tuple[str, ...]
    validation_data: tuple[str, ...] = ()
    epochs: int = DEFAULT_EPOCHS
    max_steps: int | None = None
    #: Exactly one of the two is set: a fixed global batch, or a per-rank batch.
    global_batch: int | None = DEFAULT_GLOBAL_BATCH
    batch_per_rank: int | None = None
    #: Evaluate every this many steps; None: at the end of every data epoch.
    eval_every: int | None = None
    eval_batch: int = DEFAULT_EVAL_BATCH
    commit_every: int = DEFAULT_COMMIT_EVERY
    output: str | None = None
    seed: int = 0

    @property
    def policy(self) -> str:
        """``fixed`` (a fixed global batch) or ``linear`` (per-rank batch, learning rate x
        ranks)."""
        return "fixed" if self.global_batch is not None else "linear"


def split_paths(text: str) -> tuple[str, ...]:
    """``a,b , c`` -> ``("a", "b", "c")`` (empty items dropped)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Add the training flags to ``parser`` as one argument group."""
    group = parser.add_argument_group(GROUP_TITLE, "what to train, on which data, for how long")
    group.add_argument(
        "--model-def",
        required=True,
        metavar="M",
        help="the model definition: a .py file or an importable module defining custom_model, "
        "loss, optimizer and dataset_fn (docs/model-zoo.md)",
    )
    group.add_argument(
        "--training-data",
        required=True,
        metavar="PATHS",
        help="uncompressed TFRecord files or glob patterns, comma-separated",
    )
    group.add_argument(
        "--validation-data",
        metavar="PATHS",
        help="TFRecord files or glob patterns for the distributed evaluation (default: none)",
    )
    group.add_argument(
        "--epochs",
        type=int,
        default=DEFAULT_EPOCHS,
        metavar="N",
        help=f"data epochs to train (default {DEFAULT_EPOCHS})",
    )
    group.add_argument(
        "--max-steps", type=int, metavar="N", help="stop after N global steps (default: no limit)"
    )
    batch = group.add_mutually_exclusive_group()
    batch.add_argument(
        "--global-batch",
        type=int,
        metavar="G",
        help="samples per global step, fixed whatever the number of ranks (each rank's share "
        f"changes with it; the default, {DEFAULT_GLOBAL_BATCH})",
    )
    batch.add_argument(
        "--batch-per-rank",
        type=int,
        metavar="B",
        help="samples per rank and step instead: the global batch is B x ranks and the learning "
        "rate is multiplied by the number of ranks",
    )
    group.add_argument(
        "--eval-every",
        type=int,
        metavar="STEPS",
        help="evaluate on --validation-data every STEPS global steps (default: after every data "
        "epoch); always at the end",
    )
    group.add_argument(
        "--eval-batch",
        type=int,
        default=DEFAULT_EVAL_BATCH,
        metavar="N",
        help=f"records per evaluation batch on each rank (default {DEFAULT_EVAL_BATCH})",
    )
    group.add_argument(
        "--commit-every",
        type=int,
        default=DEFAULT_COMMIT_EVERY,
        metavar="STEPS",
        help="steps between commits: a failure rolls back at most this many steps (default "
        f"{DEFAULT_COMMIT_EVERY})",
    )
    group.add_argument(
        "--output",
        metavar="DIR",
        help="export the trained model here (DIR/model.keras, DIR/saved_model/, "
        "DIR/summary.json); DIR must not exist or be empty (default: no export)",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the initial weights and of the data order (default 0)",
    )


def train_options(
    model_def: str,
    training_data: Sequence[str],
    *,
    validation_data: Sequence[str] = (),
    epochs: int = DEFAULT_EPOCHS,
    max_steps: int | None = None,
    global_batch: int | None = None,
    batch_per_rank: int | None = None,
    eval_every: int | None = None,
    eval_batch: int = DEFAULT_EVAL_BATCH,
    commit_every: int = DEFAULT_COMMIT_EVERY,
    output: str | None = None,
    seed: int = 0,
) -> TrainOptions:
    """The validated options, with the flags' defaults for what is not given."""
    if global_batch is None and batch_per_rank is None:
        global_batch = DEFAULT_GLOBAL_BATCH
    return validate(
        TrainOptions(
            model_def=model_def,
            training_data=tuple(training_data),
            validation_data=tuple(validation_data),
            epochs=epochs,
            max_steps=max_steps,
            global_batch=global_batch,
            batch_per_rank=batch_per_rank,
            eval_every=eval_every,
            eval_batch=eval_batch,
            commit_every=commit_every,
            output=output,
            seed=seed,
        )
    )


def from_args(args: argparse.Namespace) -> TrainOptions:
    """The options of a parser that :func:`add_train_flags` built (validated)."""
    return train_options(
        args.model_def,
        split_paths(args.training_data),
        validation_data=split_paths(args.validation_data or ""),
        epochs=args.epochs,
        max_steps=args.max_steps,
        global_batch=args.global_batch,
        batch_per_rank=args.batch_per_rank,
        eval_every=args.eval_every,
        eval_batch=args.eval_batch,
        commit_every=args.commit_every,
        output=args.output,
        seed=args.seed,
    )


def validate(options: TrainOptions) -> TrainOptions:
    """``options`` if training can run with them; else a ConfigError naming the flag."""
    if not options.model_def.strip():
        raise ConfigError("--model-def is empty: give a .py file or a module name")
    if not options.training_data:
        raise ConfigError("--training-data names no files: give TFRecord files or patterns")
    if any("," in path for path in (*options.training_data, *options.validation_data)):
        raise ConfigError("a data path contains ',': paths are separated by commas")
    positive = {
        "--epochs": options.epochs,
        "--max-steps": options.max_steps,
        "--global-batch": options.global_batch,
        "--batch-per-rank": options.batch_per_rank,
        "--eval-every": options.eval_every,
        "--eval-batch": options.eval_batch,
        "--commit-every": options.commit_every,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if (options.global_batch is None) == (options.batch_per_rank is None):
        raise ConfigError("give either --global-batch or --batch-per-rank, not both")
    if options.eval_every is not None and not options.validation_data:
        raise ConfigError("--eval-every needs --validation-data: there is nothing to evaluate on")
    if options.output is not None and not options.output.strip():
        raise ConfigError("--output is empty: give a folder, or leave the flag out")
    return options


def to_args(options: TrainOptions) -> list[str]:
    """The flags that :func:`from_args` reads back as ``options``."""
    args = ["--model-def", options.model_def, "--training-data", ",".join(options.training_data)]
    if options.validation_data:
        args += ["--validation-data", ",".join(options.validation_data)]
    args += ["--epochs", str(options.epochs)]
    if options.max_steps is not None:
        args += ["--max-steps", str(options.max_steps)]
    if options.global_batch is not None:
        args += ["--global-batch", str(options.global_batch)]
    else:
        args += ["--batch-per-rank", str(options.batch_per_rank)]
    if options.eval_every is not None:
        args += ["--eval-every", str(options.eval_every)]
    args += ["--eval-batch", str(options.eval_batch), "--commit-every", str(options.commit_every)]
    if options.output is not None:
        args += ["--output", options.output]
    return [*args, "--seed", str(options.seed)]
