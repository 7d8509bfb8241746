"""The model-definition contract: which names a definition defines and how they are called.

A model definition (a ``.py`` file or an importable module given to ``elastic-run train
--model-def``) defines, at module level:

=========================== ========== ===================================================
name                        required   called as, and what it returns
=========================== ========== ===================================================
``custom_model``            yes        ``custom_model()`` -> a ``tf.keras.Model``
``loss``                    yes        ``loss(labels, predictions)`` -> a scalar tensor, the
                                       mean loss over the batch
``optimizer``               yes        ``optimizer()`` -> a ``tf.keras.optimizers.Optimizer``
``dataset_fn``              yes        ``dataset_fn(dataset, mode)`` -> ``dataset`` (one
                                       serialized TFRecord record per element) mapped to
                                       ``(features, labels)`` pairs, one per record; ``mode``
                                       is ``"train"``, ``"evaluate"`` or ``"predict"``
``eval_metrics_fn``         no         ``eval_metrics_fn()`` -> a dict of name -> Keras metric
``callbacks``               no         ``callbacks()`` -> a list of Keras callbacks
``learning_rate_schedule``  no         ``learning_rate_schedule(step)`` -> the learning rate of
                                       global step ``step`` (a ``LearningRateSchedule`` works)
=========================== ========== ===================================================

This module checks names and signatures only (pure: it runs nothing it is given);
:mod:`elastic_allreduce.zoo.pipeline` checks what the functions return.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from elastic_allreduce.errors import ConfigError

#: The values of ``mode`` that ``dataset_fn`` is called with.
MODES: Final = ("train", "evaluate", "predict")


@dataclass(frozen=True)
class Piece:
    """One name of the contract."""

    name: str
    #: The positional arguments it is called with (their names, for messages).
    parameters: tuple[str, ...]
    required: bool
    #: What it must return, as the error messages say it.
    returns: str

    @property
    def call(self) -> str:
        """How it is called, e.g. ``loss(labels, predictions)``."""
        return f"{self.name}({', '.join(self.parameters)})"


PIECES: Final = (
    Piece("custom_model", (), True, "a tf.keras.Model"),
    Piece("loss", ("labels", "predictions"), True, "a scalar tensor (the mean over the batch)"),
    Piece("optimizer", (), True, "a tf.keras.optimizers.Optimizer"),
    Piece(
        "dataset_fn",
        ("dataset", "mode"),
        True,
        "a tf.data.Dataset of (features, labels) pairs, one per record",
    ),
    Piece("eval_metrics_fn", (), False, "a dict of metric name -> tf.keras.metrics.Metric"),
    Piece("callbacks", (), False, "a list of tf.keras.callbacks.Callback"),
    Piece("learning_rate_schedule", ("step",), False, "the learning rate (a number)"),
)
_BY_NAME: Final = {piece.name: piece for piece in PIECES}

UserFunction = Callable[..., Any]


@dataclass(frozen=True)
class ModelDef:
    """A model definition whose names and signatures follow the contract."""

    #: How errors name it: the file path or module name given to --model-def.
    label: str
    custom_model: UserFunction
    loss: UserFunction
    optimizer: UserFunction
    dataset_fn: UserFunction
    eval_metrics_fn: UserFunction | None = None
    callbacks: UserFunction | None = None
    learning_rate_schedule: UserFunction | None = None
    #: The source file of the definition, when it has one (copied next to the exported model).
    source_file: str | None = None

    def error(self, piece: str, problem: str) -> ConfigError:
        """A ConfigError that names this definition and the function at fault."""
        return ConfigError(f"model definition {self.label}: {_BY_NAME[piece].call} {problem}")


def piece(name: str) -> Piece:
    """The contract's entry for ``name``."""
    return _BY_NAME[name]


def _signature_problem(spec: Piece, value: object) -> str | None:
    """Why ``value`` cannot be called as ``spec`` says, or None."""
    if not callable(value):
        return f"is a {type(value).__name__}, not a function"
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: trust it
    try:
        signature.bind(*spec.parameters)
    except TypeError as exc:
        return (
            f"cannot be called with {len(spec.parameters)} argument(s) ({exc}); it is {signature}"
        )
    return None


def check_definition(
    label: str, namespace: Mapping[str, object], source_file: str | None = None
) -> ModelDef:
    """The :class:`ModelDef` of a module's names; ConfigError listing every missing or
    wrongly typed piece (each with the module and the function)."""
    problems: list[str] = []
    found: dict[str, UserFunction] = {}
    for spec in PIECES:
        value = namespace.get(spec.name)
        if value is None:
            if spec.required:
                problems.append(f"{spec.call} is missing: define it, returning {spec.returns}")
            continue
        problem = _signature_problem(spec, value)
        if problem is not None:
            problems.append(f"{spec.call} {problem}")
            continue
        found[spec.name] = value  # type: ignore[assignment]  # callable, checked above
    if problems:
        raise ConfigError(f"model definition {label}: " + "; ".join(problems))
    return ModelDef(label=label, source_file=source_file, **found)


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`."""
    if mode not in MODES:
        raise ConfigError(f"unknown dataset_fn mode {mode!r}: use one of {', '.join(MODES)}")
    return mode
