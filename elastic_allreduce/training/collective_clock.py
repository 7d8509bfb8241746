"""How long this rank's last gradient allreduce waited: the input of the launcher's straggler
watch (``launcher/leader/stragglers.py``).

In a synchronous ring every rank's step takes as long as the slowest rank's compute: the others
wait for it inside the allreduce. So the time from "this rank's local gradients are ready" to
"the reduced gradients are back" is long on fast ranks and short on a slow one, and a step's
own compute share is its step time minus that wait -- measured on one clock per rank, so no
clocks need to agree across machines.

:func:`timed` wraps the allreduce of a Horovod ``DistributedGradientTape`` or Keras
``DistributedOptimizer``: two ``tf.timestamp`` ops, one after the local gradients (a control
dependency on each), one after the reduced ones, both written into one float64 variable of
this process. They run inside the compiled step (no Python per step, no extra host sync); the
progress beacon reads the variable about once a second. ``ea.DistributedGradientTape`` and
``ea.DistributedOptimizer`` are timed, and under ``elastic-run`` so are Horovod's own
(:mod:`elastic_allreduce.bootstrap.hooks`), for custom loops and Keras ``fit`` alike. Not measured:
scripts that call Horovod's allreduce themselves, and an optimizer with
``backward_passes_per_step`` above 1 (Horovod binds its allreduce before it can be wrapped);
their reports carry no wait and the watch skips the ring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

from elastic_allreduce import progress

_lock = threading.Lock()
_clock: tf.Variable | None = None


_F = TypeVar("_F", bound=Callable[..., Any])


def _as_python(func: _F) -> _F:
    """``func``, run as plain Python when a step that calls it is traced (AutoGraph would try
    to convert it, fail on its closures and warn)."""
    plain: _F = tf.autograph.experimental.do_not_convert(func)
    return plain


@_as_python
def _variable() -> tf.Variable:
    """The process's [ready, done] timestamps of the last allreduce, made once, eagerly.

    It is first asked for while a user's step is traced -- and often not during its first
    trace: Horovod's documented warm-up traces the step once without the tape wrapped. A
    ``tf.Variable`` made in any later trace fails ("tf.function only supports singleton
    tf.Variables created on the first call"), also under ``tf.init_scope()``, whose variable
    creators are the trace's. So it is made on a thread of its own: eager, outside every
    trace of the script's thread, whatever is being traced there. Nothing is made before the
    first timed allreduce, so importing or installing this never starts TensorFlow's runtime
    (the script may still choose its GPUs)."""
    global _clock  # noqa: PLW0603 - one clock per process
    with _lock:
        if _clock is None:
            made: list[tf.Variable] = []
            failed: list[BaseException] = []

            def make() -> None:
                try:
                    with tf.device("/CPU:0"):  # tf.timestamp runs there; read by the beacon
                        made.append(
                            tf.Variable(
                                tf.zeros([2], tf.float64),
                                trainable=False,
                                name="elastic_allreduce_clock",
                            )
                        )
                except BaseException as exc:  # re-raised on the caller's thread
                    failed.append(exc)

            maker = threading.Thread(target=make, name="collective-clock", daemon=True)
            maker.start()
            maker.join()
            if failed:
                raise failed[0]
            _clock = made[0]
            progress.set_collective_clock(last_wait)
        return _clock


def last_wait() -> float | None:
    """Seconds the last timed allreduce took from local gradients to reduced ones (None before
    the first one)."""
    with _lock:
        clock = _clock
    if clock is None:
        return None
    ready, done = (float(v) for v in clock.numpy())
    return max(0.0, done - ready) if done > 0 else None


def _tensors(gradients: list[Any]) -> list[tf.Tensor]:
    """The dense tensors a control dependency can wait on (IndexedSlices: their values)."""
    tensors = []
    for gradient in gradients:
        if gradient is None:
            continue
        tensors.append(gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient)
    return tensors


#: Marks an object whose allreduce is timed already.
_TIMED = "_elastic_allreduce_timed"


def timed(tape: Any) -> Any:  # noqa: ANN401 - Horovod's classes are made at run time
    """``tape`` -- a Horovod ``DistributedGradientTape`` or Keras ``DistributedOptimizer`` --
    with its allreduce timed (once: a second call changes nothing). An object without
    Horovod's ``_allreduce_grads`` is returned as it is."""
    allreduce = getattr(tape, "_allreduce_grads", None)
    if allreduce is None or getattr(tape, _TIMED, False):
        return tape

    @_as_python
    def timed_allreduce(gradients: list[Any], sources: list[Any], *args: Any) -> Any:  # noqa: ANN401
        clock = _variable()
        with tf.control_dependencies(_tensors(gradients)):
            ready = tf.timestamp()
        reduced = allreduce(gradients, sources, *args)
        with tf.control_dependencies([ready, *_tensors(list(reduced))]):
            done = tf.timestamp()
            clock.assign(tf.stack([ready, done]))
        return reduced

    tape._allreduce_grads = timed_allreduce
    setattr(tape, _TIMED, True)
    return tape
