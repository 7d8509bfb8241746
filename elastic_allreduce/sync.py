"""The agreement that runs before every state sync, so that a sync can fail but never hang.

:func:`agree` is the first collective of ``elastic_allreduce.State.sync`` and, under
`elastic-run`, of Horovod's own ``TensorFlowKerasState.sync`` (see :mod:`elastic_allreduce.hooks`).
Every rank describes its state (:mod:`elastic_allreduce.agreement`), the descriptions are
allgathered once as JSON bytes, and every rank reaches the same verdict:

* a rank whose Keras optimizer has not created its variables yet (a restarted process that has
  not trained a step, in a script without Horovod's warm-up step) creates them now, without
  changing them -- the broadcast that follows overwrites them with the root's values -- and the
  ranks describe their state once more;
* any other difference raises :class:`~elastic_allreduce.errors.StateMismatchError` on every
  rank at once, with the same message naming the first rank that differs and the variable.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Final

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from elastic_allreduce import agreement, runtime
from elastic_allreduce.agreement import StateDescription, VariableSpec
from elastic_allreduce.errors import StateMismatchError

log = logging.getLogger(__name__)

#: The name of the agreement's allgather (Horovod matches collectives by name).
COLLECTIVE_NAME: Final = "ElasticAllreduceStateAgreement"


def agree(
    model: Any,  # noqa: ANN401 - a Keras model
    optimizer: Any,  # noqa: ANN401 - a Keras optimizer (new-style or legacy), or None
    attributes: Mapping[str, object],
    *,
    commit_id: int | None = None,
) -> int:
    """Agree on the state's shape with every rank; return the rank to sync from.

    With ``commit_id`` (``elastic_allreduce.State``) the root is the lowest rank holding the
    newest commit, else rank 0 (Horovod's own states). Raises StateMismatchError, on every rank,
    when the ranks' states cannot be synced.
    """
    if hvd.size() == 1:
        return 0
    descriptions = _gather(describe(model, optimizer, attributes, commit_id))
    builders = agreement.ranks_to_build(descriptions)
    if builders:
        if hvd.rank() in builders:
            build_optimizer(optimizer, model)
        descriptions = _gather(describe(model, optimizer, attributes, commit_id))
    root = 0 if commit_id is None else agreement.newest_commit_root(descriptions)
    problem = agreement.first_mismatch(descriptions, root)
    if problem is not None:
        raise StateMismatchError(problem)
    return root


def describe(
    model: Any,  # noqa: ANN401
    optimizer: Any,  # noqa: ANN401
    attributes: Mapping[str, object],
    commit_id: int | None = None,
) -> StateDescription:
    """This rank's state as the ranks compare it."""
    return StateDescription(
        model=_specs(model.variables),
        optimizer=() if optimizer is None else _specs(optimizer.variables()),
        optimizer_built=optimizer_built(optimizer),
        extra_keys=tuple(sorted(attributes)),
        commit_id=commit_id,
        slot=runtime.slot(),
    )


def _specs(variables: Iterable[Any]) -> tuple[VariableSpec, ...]:
    return tuple(
        VariableSpec(str(v.name), tuple(v.shape.as_list()), str(v.dtype.name)) for v in variables
    )


def optimizer_built(optimizer: Any) -> bool:  # noqa: ANN401
    """Whether a Keras 2 optimizer has created its variables (slots, iteration count)."""
    if optimizer is None:
        return True
    if hasattr(optimizer, "_create_all_weights"):
        # Legacy OptimizerV2: no variables at all until its first step.
        return bool(optimizer.variables())
    if callable(getattr(optimizer, "build", None)):
        # The optimizers of TF 2.11+ (Keras 2): `iterations` exists from the start, and
        # `build(var_list)` sets `_built` when it has created the slots.
        return bool(getattr(optimizer, "_built", False))
    return bool(optimizer.variables())


def build_optimizer(optimizer: Any, model: Any) -> None:  # noqa: ANN401
    """Create the optimizer's variables for the model's trainable variables as its first step
    would -- under the same name scope, so that they get the same names as on ranks that
    trained (Horovod names each variable's broadcast after it) -- without applying any update.

    Never raises: a failure shows up as a mismatch on every rank (raising here, on this rank
    alone, would leave the others waiting in the next allgather)."""
    try:
        if hasattr(optimizer, "_create_all_weights"):
            with tf.name_scope(optimizer._name), tf.init_scope():
                optimizer._create_all_weights(model.trainable_variables)
        else:
            with tf.name_scope(optimizer.name or "optimizer"), tf.init_scope():
                optimizer.build(model.trainable_variables)
    except Exception as exc:  # any failure is reported by the agreement that follows
        log.warning("could not create the optimizer's variables before the sync: %r", exc)
    else:
        log.info(
            "created the optimizer's %d variables before the sync (this process has not "
            "trained a step yet); the sync overwrites them",
            len(optimizer.variables()),
        )


def _gather(description: StateDescription) -> list[StateDescription]:
    payload = np.frombuffer(description.encode(), dtype=np.uint8)
    gathered = hvd.allgather(tf.constant(payload), name=COLLECTIVE_NAME)
    return agreement.decode_all(gathered.numpy().tobytes(), hvd.size())
