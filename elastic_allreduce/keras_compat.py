"""Keras 3 beside legacy Keras: which one an object belongs to, and gradient averaging for
Keras 3 optimizers.

TensorFlow >= 2.16's ``tf.keras`` is Keras 3 unless ``TF_USE_LEGACY_KERAS=1`` (then it is
tf-keras, Keras 2, as TensorFlow 2.15's was). Horovod's ``DistributedOptimizer`` averages
gradients in a hook (``_compute_gradients``) that Keras 3 never calls: around a Keras 3
optimizer every rank would train alone, silently. :func:`distributed_optimizer` is the Keras 3
counterpart: the wrapped optimizer's ``apply`` -- which Keras 3's ``fit``, ``apply_gradients``
and custom loops all go through -- first averages the gradients with Horovod's allreduce (the
same grouping, compression and sparse handling as Horovod's), then applies them.
:func:`refuse_keras3` is what Horovod's own wrapper says instead of training alone.
"""

from __future__ import annotations

import sys
from typing import Any

import horovod.tensorflow as hvd

from elastic_allreduce.errors import ConfigError

#: The fix, named in every refusal.
FIX = (
    "use elastic_allreduce.DistributedOptimizer (it averages gradients for Keras 3 "
    "optimizers), or legacy Keras: pip install tf-keras and set TF_USE_LEGACY_KERAS=1"
)

#: Marks an optimizer class that averages its gradients in ``apply``.
_REDUCES = "_elastic_allreduce_reduces"


def is_keras3(obj: object) -> bool:
    """Whether ``obj`` (an optimizer, model, layer or variable, or an instance of a script's own
    subclass of one) is Keras 3's. Keras 2 (TF 2.15's ``keras`` package) and tf-keras (module
    ``tf_keras``) are not; nothing is imported."""
    if not any(cls.__module__.startswith("keras.") for cls in type(obj).__mro__):
        return False
    keras = sys.modules.get("keras")
    version = getattr(keras, "__version__", "0")
    return int(str(version).split(".", 1)[0]) >= 3


def optimizer_variables(optimizer: Any) -> list[Any]:  # noqa: ANN401 - either Keras's optimizer
    """An optimizer's variables: a method in Keras 2, a property in Keras 3."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def tf_variable(variable: Any) -> Any:  # noqa: ANN401 - any Keras's variable
    """The ``tf.Variable`` behind a Keras 3 variable (its ``value``); any other as it is. A Keras
    3 variable handed to a ``tf.function`` is traced as an array, which fails in a graph."""
    if hasattr(variable, "ref"):
        return variable
    inner = getattr(variable, "value", None)
    return inner if hasattr(inner, "ref") else variable


def refuse_keras3(optimizer: object, wrapper: str) -> None:
    """ConfigError if ``wrapper`` (Horovod's ``DistributedOptimizer``) was given a Keras 3
    optimizer, which it would never reduce."""
    if is_keras3(optimizer) and not getattr(type(optimizer), _REDUCES, False):
        raise ConfigError(
            f"{wrapper} cannot wrap a Keras 3 optimizer ({type(optimizer).__name__}): Keras 3 "
            f"never calls the hook in which Horovod averages the gradients, so every rank would "
            f"train alone; {FIX}"
        )


def distributed_optimizer(  # noqa: PLR0917 - Horovod's DistributedOptimizer's positions
    optimizer: Any,  # noqa: ANN401 - a Keras 3 optimizer of any class
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = hvd.Compression.none,  # noqa: ANN401 - Horovod's compressor classes
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,  # noqa: ANN401 - Horovod's reduce ops
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,  # noqa: ANN401 - Horovod's groups: an int or lists of variables
    process_set: Any = hvd.global_process_set,  # noqa: ANN401 - a Horovod ProcessSet
) -> Any:  # noqa: ANN401
    """A new optimizer of ``optimizer``'s class and configuration whose ``apply`` averages the
    gradients across ranks first (Horovod's ``DistributedOptimizer`` arguments; Keras 3's own
    ``gradient_accumulation_steps`` replaces ``backward_passes_per_step``). Saved models
    record the original class, so they load without this module."""
    if backward_passes_per_step != 1 or average_aggregated_gradients:
        raise ConfigError(
            "backward_passes_per_step is Horovod's gradient accumulation for Keras 2; for a "
            "Keras 3 optimizer pass gradient_accumulation_steps=N to the optimizer itself"
        )
    if num_groups and groups is None:
        groups = num_groups
    base = type(optimizer)
    if getattr(base, _REDUCES, False):
        return optimizer
    allreduce_grads = hvd._make_allreduce_grads_fn(
        name or f"Distributed{base.__name__}",
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        groups,
        process_set,
    )

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:  # noqa: ANN401
        grads = list(grads)
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else list(self._trainable_variables)
        )
        reduced = self._allreduce_grads(grads, [tf_variable(v) for v in variables])
        return base.apply(self, list(reduced), trainable_variables)

    subclass: Any = type(
        base.__name__,
        (base,),
        {
            "apply": apply,
            _REDUCES: True,
            # Serialised as the original class: a saved model reloads without this module.
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        },
    )
    wrapped = subclass.from_config(optimizer.get_config())
    wrapped._allreduce_grads = allreduce_grads
    return wrapped
