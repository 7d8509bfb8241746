"""Warm joiners (``--warm-join``, the default): a newcomer runs its script up to its elastic run
at a ring of one, and only then joins.

Without it a process that joins a running ring waits at the launcher's readiness barrier and
only runs the script once its ring epoch started: it builds the model and traces its first
step while every other rank waits for it in the state broadcast (bench item 4: about 2 s) --
and whatever its script does with collectives before its elastic run (Horovod's examples run a
warm-up step) meets the others' state sync: a hang.

A warm joiner -- a process that starts once the job has trained (a scale-up, a restarted or
replaced process) -- runs the script at once, with Horovod initialised as a ring of its own
(rank 0 of 1: no peers, no rendezvous), and asks to join only when the script enters its
elastic run (``ea.run`` or ``hvd.elastic.run``), before the first state sync. Meanwhile the ring
trains on: the imports, the model and optimizer, the script's own warm-up and the step given to
:func:`warm_up` happen off everyone else's clock. At a ring of one Horovod's gradient allreduce
is skipped, and in elastic mode the size is read when a step runs, not when it is traced, so the
trace stays valid in the ring. Then the process puts its state back to what it was before the
warm-up, initialises Horovod again with its rank in the ring -- as every member does at a reset
-- and runs the state's reset callbacks; the sync gives it the ring's committed state.

What code before the elastic run sees, for ``ea.State`` and plain Horovod scripts alike: rank 0
of size 1. Collectives there are local (a sum is this process's own value), and work that the
script gives to rank 0 (writing files, printing) runs in every warm joiner (a Keras
``ModelCheckpoint`` made there saves only while the process is rank 0 of the ring:
:mod:`elastic_allreduce.bootstrap.hooks`). Values that depend on the rank or size belong in reset
callbacks (``state.register_reset_callbacks``, ``ea.State(on_resize=...)``), as for any elastic
Horovod script, whose ranks change at every reset. Before the job's first epoch ran, every
process starts with the first ring: nobody holds a state to sync yet.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Final

from elastic_allreduce import env, runtime
from elastic_allreduce.errors import ConfigError

log = logging.getLogger("elastic_allreduce.training.warm")

#: Horovod's variables for a ring of one process.
SOLO_RANKS: Final = ("0", "1", "0", "1", "0", "1")
#: Horovod's variables that make ``hvd.init()`` meet its peers (put back at the admission:
#: the rendezvous is this process's relay to the launcher).
_PEER_VARIABLES: Final = (env.HOROVOD_RENDEZVOUS_ADDR, env.HOROVOD_RENDEZVOUS_PORT)

#: The bootstrap's admission: tells the launcher the warm-up step's seconds (None: not
#: measured), waits until it admitted this slot to a ring epoch, sets Horovod's variables for
#: it and returns the epoch (exits when not admitted).
Admit = Callable[[float | None], int]

_pending: list[Admit] = []
_started: list[float] = []
_peers: dict[str, str] = {}
_measured: list[float] = []


def defer(admit: Admit) -> None:
    """Run the script as a ring of one until its elastic run calls :func:`join` (bootstrap)."""
    for name, value in zip(env.HOROVOD_RANK_VARIABLES, SOLO_RANKS, strict=True):
        os.environ[name] = value
    _peers.clear()
    for name in _PEER_VARIABLES:
        if name in os.environ:
            _peers[name] = os.environ.pop(name)
    os.environ.pop(env.HOROVOD_ELASTIC, None)
    _pending[:] = [admit]
    _started[:] = [time.monotonic()]
    _after_init_set_elastic()


class NeverJoinedError(ConfigError):
    """A warm joiner's script ended without entering an elastic run: what it trained at its
    ring of one is nobody's (the bootstrap reports it as the script's error)."""


def check_joined() -> None:
    """NeverJoinedError when this process warmed up and its script has ended without joining
    (no ``hvd.elastic.run`` / ``ea.run``); nothing otherwise."""
    if _pending:
        raise NeverJoinedError(
            f"slot {runtime.slot()}: the script ended without entering an elastic run "
            "(hvd.elastic.run or ea.run). This process started while the job trained, so it ran "
            "the script at a ring of one (--warm-join) and would have joined the ring there; "
            "what it trained alone is discarded. Train inside an elastic run, or start the job "
            "with --no-warm-join"
        )


def provisional() -> bool:
    """Whether this process runs as a ring of one until it joins (``--warm-join``)."""
    return bool(_pending)


def warm_up(step: Callable[[], object]) -> bool:
    """Run ``step`` now if this process warms up before it joins; whether it ran.

    Give it the compiled training step on an example batch of the shape the ring will use
    (``lambda: train_step(x, y)``, or ``lambda: model.train_on_batch(x, y)`` for Keras ``fit``):
    its first trace then happens before the process joins. It runs twice: the second run's time
    (no trace) goes to the launcher, which compares it with the ring's share of a step (a slow
    machine is reported before it slows the ring). Its effect on the state is undone when the
    process joins; outside a warm joiner it does nothing, so scripts call it always.
    """
    if not provisional():
        return False
    began = time.monotonic()
    step()
    traced = time.monotonic()
    step()
    done = time.monotonic()
    _measured[:] = [done - traced]
    log.info(
        "slot %s: warm-up step took %.2f s, then %.4f s traced",
        runtime.slot(),
        traced - began,
        done - traced,
    )
    return True


def join(state: Any) -> None:  # noqa: ANN401 - a Horovod elastic state of any kind
    """In a warm joiner, at the elastic run's start: undo the warm-up, ask to join, initialise
    Horovod in the ring and run the state's reset callbacks; nothing otherwise."""
    if not _pending:
        return
    import horovod.tensorflow as hvd  # noqa: PLC0415 - TensorFlow, loaded by the script already
    from horovod.tensorflow.elastic import TensorFlowKerasState  # noqa: PLC0415

    admit = _pending.pop()
    if isinstance(state, TensorFlowKerasState):
        # Horovod's own restore: the saved copy back into the variables (ea.State's would
        # count a rollback).
        TensorFlowKerasState.restore(state)
    ready = time.monotonic()
    log.info(
        "slot %s: ready to join %.2f s after the script started; asking the launcher",
        runtime.slot(),
        ready - _started[0],
    )
    epoch = admit(_measured[0] if _measured else None)
    os.environ.update(_peers)
    hvd.shutdown()
    hvd.init()
    runtime.set_ring_epoch(epoch)
    state.on_reset()


def _after_init_set_elastic() -> None:
    """Make the first ``hvd.init()`` a ring of one, and every trace after it elastic.

    Horovod reads ``HOROVOD_ELASTIC`` twice: its C++ side at ``init`` (elastic: ask the
    rendezvous, which a ring of one has not) and its Python side when a step is traced (elastic:
    the size is an op that runs with the step, not a constant of the trace). So it is off
    while the solo ring starts and on from then on."""
    from horovod.common.basics import HorovodBasics  # noqa: PLC0415

    basics: Any = HorovodBasics
    original = basics.init
    if getattr(original, "_elastic_allreduce_warm", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        try:
            original(self, *args, **kwargs)
        finally:
            if _pending:
                os.environ[env.HOROVOD_ELASTIC] = "1"

    init._elastic_allreduce_warm = True  # type: ignore[attr-defined]
    basics.init = init
