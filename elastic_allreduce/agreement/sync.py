"""The agreement that runs before every state sync, so that a sync can fail but never hang.

:func:`agree` is the first collective of ``elastic_allreduce.State.sync`` and, under
`elastic-run`, of Horovod's own ``TensorFlowKerasState.sync`` (see
:mod:`elastic_allreduce.bootstrap.hooks`).
Every rank describes its state (:mod:`elastic_allreduce.agreement.shape`), the descriptions are
allgathered once as JSON bytes, and every rank reaches the same verdict:

* a rank whose Keras optimizer has not created its variables yet (a restarted process that has
  not trained a step, in a script without Horovod's warm-up step) creates them now, without
  changing them -- the broadcast that follows overwrites them with the root's values -- and the
  ranks describe their state once more;
* any other difference raises :class:`~elastic_allreduce.errors.StateMismatchError` on every
  rank at once, with the same message naming the first rank that differs and the variable.

The other collectives of a state move plain data, never pickles
(:mod:`elastic_allreduce.agreement.plain`):
:func:`broadcast_attributes` sends the extra attributes at a sync as JSON bytes (the length,
then the bytes), and :func:`check_host_updates` is Horovod's commit-time host-update check with
one Max allreduce of six integers instead of a pickled broadcast, batched: the ranks vote at the
first commit after a sync and then about every ``plain.VOTE_INTERVAL`` seconds
(``ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL``), at the same commit on every rank.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.common.exceptions import HostsUpdatedInterrupt

from elastic_allreduce import env, keras_compat, runtime
from elastic_allreduce.agreement import plain, shape
from elastic_allreduce.agreement.shape import StateDescription, VariableSpec
from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ProtocolError, StateMismatchError, StateValueError

log = logging.getLogger(__name__)

#: The name of the agreement's allgather (Horovod matches collectives by name).
COLLECTIVE_NAME: Final = "ElasticAllreduceStateAgreement"
#: The names of the attribute broadcast's two parts: the length, then the bytes.
ATTRIBUTES_LENGTH_NAME: Final = "ElasticAllreduceStateAttributes.length"
ATTRIBUTES_NAME: Final = "ElasticAllreduceStateAttributes.bytes"
#: The name of the commit-time host-update vote.
HOST_UPDATES_NAME: Final = "ElasticAllreduceHostUpdates"


def agree(
    model: Any,  # noqa: ANN401 - a Keras model
    optimizer: Any,  # noqa: ANN401 - a Keras optimizer (new-style or legacy), or None
    attributes: Mapping[str, object],
    *,
    commit_id: int | None = None,
) -> int:
    """Agree on the state's shape with every rank; return the rank to sync from.

    With ``commit_id`` (``elastic_allreduce.State``, and Horovod's own states under
    `elastic-run`, which count their commits in :mod:`elastic_allreduce.bootstrap.hooks`) the root
    is the
    lowest rank holding the newest commit, else rank 0. Raises StateMismatchError, on every
    rank, when the ranks' states cannot be synced.
    """
    return _agree(model, optimizer, attributes, commit_id)[0]


def agree_on_newest(
    model: Any,  # noqa: ANN401
    optimizer: Any,  # noqa: ANN401
    attributes: Mapping[str, object],
    commit_id: int,
) -> tuple[int, int]:
    """:func:`agree` by commit ids: the rank to sync from and its commit id, the newest of any
    rank's (which every rank then holds)."""
    root, newest = _agree(model, optimizer, attributes, commit_id)
    return root, commit_id if newest is None else newest


def _agree(
    model: Any,  # noqa: ANN401
    optimizer: Any,  # noqa: ANN401
    attributes: Mapping[str, object],
    commit_id: int | None,
) -> tuple[int, int | None]:
    if hvd.size() == 1:
        return 0, commit_id
    descriptions = _gather(describe(model, optimizer, attributes, commit_id))
    builders = shape.ranks_to_build(descriptions)
    if builders:
        if hvd.rank() in builders:
            build_optimizer(optimizer, model)
        descriptions = _gather(describe(model, optimizer, attributes, commit_id))
    root = 0 if commit_id is None else shape.newest_commit_root(descriptions)
    problem = shape.first_mismatch(descriptions, root)
    if problem is not None:
        raise StateMismatchError(problem)
    return root, descriptions[root].commit_id


def describe(
    model: Any,  # noqa: ANN401
    optimizer: Any,  # noqa: ANN401
    attributes: Mapping[str, object],
    commit_id: int | None = None,
) -> StateDescription:
    """This rank's state as the ranks compare it."""
    return StateDescription(
        model=_specs(model.variables),
        optimizer=() if optimizer is None else _specs(keras_compat.optimizer_variables(optimizer)),
        optimizer_built=optimizer_built(optimizer),
        extra_keys=tuple(sorted(attributes)),
        commit_id=commit_id,
        slot=runtime.slot(),
    )


def _specs(variables: Iterable[Any]) -> tuple[VariableSpec, ...]:
    """Name, shape and dtype of each variable (a Keras 3 variable: its path, unique where its
    name is not, a tuple shape and a dtype string)."""
    return tuple(
        VariableSpec(
            str(getattr(v, "path", None) or v.name),
            tuple(tf.TensorShape(v.shape).as_list()),
            tf.as_dtype(v.dtype).name,
        )
        for v in variables
    )


def optimizer_built(optimizer: Any) -> bool:  # noqa: ANN401
    """Whether a Keras 2 optimizer has created its variables (slots, iteration count)."""
    if optimizer is None:
        return True
    if hasattr(optimizer, "_create_all_weights"):
        # Legacy OptimizerV2: no variables at all until its first step.
        return bool(keras_compat.optimizer_variables(optimizer))
    if callable(getattr(optimizer, "build", None)):
        # The optimizers of TF 2.11+ (Keras 2) and Keras 3: `iterations` exists from the start,
        # and `build(var_list)` sets `_built` (Keras 2) or `built` (Keras 3) once it has
        # created the slots.
        return bool(getattr(optimizer, "_built", False) or getattr(optimizer, "built", False))
    return bool(keras_compat.optimizer_variables(optimizer))


def build_optimizer(optimizer: Any, model: Any) -> None:  # noqa: ANN401
    """Create the optimizer's variables for the model's trainable variables as its first step
    would -- under the same name scope, so that they get the same names as on ranks that
    trained (Horovod names each variable's broadcast after it) -- without applying any update.
    Keras 2 creates them in the optimizer's name scope; Keras 3's ``build`` opens that scope
    itself (another one around it would name them ``adam/adam/...``: a broadcast no rank that
    trained takes part in).

    Never raises: a failure shows up as a mismatch on every rank (raising here, on this rank
    alone, would leave the others waiting in the next allgather)."""
    try:
        if hasattr(optimizer, "_create_all_weights"):
            with tf.name_scope(optimizer._name), tf.init_scope():
                optimizer._create_all_weights(model.trainable_variables)
        elif keras_compat.is_keras3(optimizer):
            with tf.init_scope():
                optimizer.build(model.trainable_variables)
        else:
            with tf.name_scope(optimizer.name or "optimizer"), tf.init_scope():
                optimizer.build(model.trainable_variables)
    except Exception as exc:  # any failure is reported by the agreement that follows
        log.warning("could not create the optimizer's variables before the sync: %r", exc)
    else:
        log.info(
            "created the optimizer's %d variables before the sync (this process has not "
            "trained a step yet); the sync overwrites them",
            len(keras_compat.optimizer_variables(optimizer)),
        )


def _gather(description: StateDescription) -> list[StateDescription]:
    payload = np.frombuffer(description.encode(), dtype=np.uint8)
    gathered = hvd.allgather(tf.constant(payload), name=COLLECTIVE_NAME)
    return shape.decode_all(gathered.numpy().tobytes(), hvd.size())


# -- plain data instead of pickles -------------------------------------------------------------


def broadcast_attributes(attributes: Mapping[str, object], root: int) -> dict[str, JsonValue]:
    """The root's extra attributes, on every rank, as JSON bytes: the length (-1: the root's
    attributes are not plain data), then the bytes; every rank (the root too) parses the same
    bytes. StateValueError or ProtocolError on every rank when they cannot be sent or read."""
    refusal: StateValueError | None = None
    payload = b""
    if hvd.rank() == root:
        try:
            payload = plain.encode_attributes(attributes)
        except StateValueError as exc:
            refusal = exc
    if hvd.size() == 1:
        if refusal is not None:
            raise refusal
        return plain.decode_attributes(payload, sender="this rank", expected=attributes.keys())
    length = -1 if refusal is not None else len(payload)
    announced = hvd.broadcast(
        tf.constant([length], dtype=tf.int64), root_rank=root, name=ATTRIBUTES_LENGTH_NAME
    )
    length = int(announced.numpy()[0])
    if length < 0:
        if refusal is not None:
            raise refusal
        raise StateValueError(
            f"cannot sync the training state: rank {root}, the rank it is synced from, holds a "
            "State attribute that is not plain data (its own error names it)"
        )
    if length > plain.MAX_BYTES:
        raise ProtocolError(
            f"rank {root} announced {length} bytes of state attributes, more than {plain.MAX_BYTES}"
        )
    if hvd.rank() == root:
        buffer = np.frombuffer(payload, dtype=np.uint8)
    else:
        buffer = np.zeros(length, dtype=np.uint8)
    received = hvd.broadcast(tf.constant(buffer), root_rank=root, name=ATTRIBUTES_NAME)
    return plain.decode_attributes(
        received.numpy().tobytes(), sender=f"rank {root}", expected=attributes.keys()
    )


def plain_commit(state: Any) -> StateValueError | None:  # noqa: ANN401 - a Horovod state
    """Make the committed attributes (``state._saved_state``, just saved) a plain copy, NumPy
    scalars converted; the error, not raised, when one is not plain data: the host-update vote
    that follows raises it on every rank at once."""
    try:
        state._saved_state = plain.plain_attributes(state._saved_state)
    except StateValueError as exc:
        return exc
    return None


#: Where a state keeps its VoteClock.
_VOTE_CLOCK: Final = "_elastic_allreduce_vote_clock"


def vote_interval() -> float:
    """Seconds between host-update votes: ``ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL``, else
    :data:`elastic_allreduce.agreement.plain.VOTE_INTERVAL` (0: at every commit)."""
    return env.seconds(
        env.HOST_CHECK_INTERVAL,
        plain.VOTE_INTERVAL,
        below=3600,
        hint="seconds between the ranks' host-update votes (0: at every commit)",
    )


def restart_votes(state: Any) -> None:  # noqa: ANN401 - a Horovod state
    """After a state sync (every rank syncs together): the next commit votes, and the count of
    commits starts again -- the same on every rank, a joiner's too."""
    setattr(state, _VOTE_CLOCK, plain.VoteClock())


def check_host_updates(
    state: Any,  # noqa: ANN401 - a Horovod state
    refusal: StateValueError | None = None,
    *,
    at_commit: bool = False,
) -> None:
    """Horovod's ``State.check_host_updates`` with one Max allreduce of six integers instead
    of rank 0's pickled broadcast: raise HostsUpdatedInterrupt, on every rank at the same commit,
    when any rank has a notification newer than any rank had seen (``skip_sync`` when all new
    ones announced removals only). With ``refusal`` (this rank's committed attributes are not
    plain data) every rank raises StateValueError instead.

    ``at_commit``: called by a commit, which votes only when its :class:`plain.VoteClock` says
    so (about every :func:`vote_interval` seconds); between votes notifications wait in the
    state's queue, and a refusal waits for the vote. Without it (the script's own call, on
    every rank) the ranks vote now."""
    clock: plain.VoteClock = getattr(state, _VOTE_CLOCK, None) or plain.VoteClock()
    pending: StateValueError | None = getattr(state, "_elastic_allreduce_refusal", None)
    refusal = pending or refusal
    if at_commit:
        clock, votes = clock.commit()
        if not votes:
            setattr(state, _VOTE_CLOCK, clock)
            state._elastic_allreduce_refusal = refusal
            return
    state._elastic_allreduce_refusal = None
    now = time.monotonic()
    rank, size = hvd.rank(), hvd.size()
    vote = plain.HostUpdateVote.drain(
        int(state._last_updated_timestamp),
        _drain(state._host_messages),
        refused=size - rank if refusal is not None else 0,
        next_in=clock.asks(now, vote_interval()),
    )
    if size == 1:
        reduced = vote.vector()
    else:
        combined = hvd.allreduce(
            tf.constant(vote.vector(), dtype=tf.int64), op=hvd.Max, name=HOST_UPDATES_NAME
        )
        reduced = [int(v) for v in combined.numpy()]
    verdict = plain.decide(reduced, size)
    setattr(state, _VOTE_CLOCK, clock.voted(now, verdict.next_in))
    if verdict.refused_rank is not None:
        if refusal is not None:
            raise refusal
        raise StateValueError(
            f"cannot commit the training state: rank {verdict.refused_rank} holds a State "
            "attribute that is not plain data (its own error names it)"
        )
    state._last_updated_timestamp = verdict.timestamp
    if verdict.interrupt:
        raise HostsUpdatedInterrupt(verdict.skip_sync)


def _drain(messages: queue.Queue[tuple[Any, Any]]) -> list[tuple[int, int]]:
    """The notifications queued since the last check (Horovod's listener puts them), in order."""
    drained: list[tuple[int, int]] = []
    while True:
        try:
            timestamp, update = messages.get_nowait()
        except queue.Empty:
            return drained
        drained.append((int(timestamp), int(update)))
