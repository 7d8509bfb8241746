"""``ea.run``: Horovod's elastic ``run``, without its silent return on a failed collective.

Horovod's ``horovod.tensorflow.elastic.run`` turns a TensorFlow ``UnknownError`` into
``HorovodInternalError`` (roll back, re-form, go on) only when the error's message names
``HorovodAllreduce``, ``HorovodAllgather`` or ``HorovodBroadcast``; any other ``UnknownError`` is
caught and dropped, and the wrapped training function *returns None* as if it had finished. A
collective given a name (``hvd.allreduce(x, name="loss")``) fails with a message that names the
op by that name, so a peer's crash during it ends training early and silently: the job
"succeeds" with a fraction of its steps (seen in the model zoo's runner, about one run in five).

:func:`run` classifies the error instead: a TensorFlow error whose message comes from Horovod or
its transports (Gloo, NCCL) is a failed collective and becomes ``HorovodInternalError``; any
other error propagates unchanged -- never dropped. A warm joiner (``--warm-join``) joins the
ring when it enters :func:`run` (:mod:`elastic_allreduce.training.warm`). The bootstrap installs it
as
``hvd.elastic.run`` too (:mod:`elastic_allreduce.bootstrap.hooks`), for plain Horovod scripts.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import horovod.tensorflow.elastic as hvd_elastic
import tensorflow as tf
from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from elastic_allreduce.training import warm

_T = TypeVar("_T")

#: Words in the message of a TensorFlow error raised by a failed collective: Horovod's own
#: statuses ("Horovod has been shut down ..."), its op names, and its transports' errors
#: (a Gloo source path such as ``gloo/transport/tcp/pair.cc``, NCCL's ``ncclSystemError``).
_COLLECTIVE_FAILURE: Final = re.compile(r"horovod|gloo|nccl", re.IGNORECASE)

#: The TensorFlow errors Horovod's ops raise when a collective fails.
_COLLECTIVE_ERRORS: Final = (tf.errors.UnknownError, tf.errors.AbortedError)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a TensorFlow error raised by a failed Horovod collective."""
    if not isinstance(error, _COLLECTIVE_ERRORS):
        return False
    message = getattr(error, "message", None) or str(error)
    return bool(_COLLECTIVE_FAILURE.search(message))


def run(func: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``func(state, ...)`` elastically (Horovod's semantics: sync the state, run, and on a
    failed collective restore the last commit, reset and run again); see the module docstring
    for the one difference."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> _T:  # noqa: ANN401
        try:
            return func(state, *args, **kwargs)
        except _COLLECTIVE_ERRORS as error:
            if is_collective_failure(error):
                raise HorovodInternalError(error) from error
            raise

    # Looked up at each reset: the bootstrap replaces Horovod's reset (hooks.QuietReset).
    def reset() -> None:
        hvd_elastic._reset()

    elastic: Callable[..., _T] = run_fn(wrapper, reset)

    @functools.wraps(func)
    def entry(state: Any, *args: Any, **kwargs: Any) -> _T:  # noqa: ANN401
        # A warm joiner (--warm-join) asks to join here, before the first sync.
        warm.join(state)
        return elastic(state, *args, **kwargs)

    return entry
