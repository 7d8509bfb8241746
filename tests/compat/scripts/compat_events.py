"""What the compatibility scripts tell the test -- not part of the patterns they show.

Every script is written as Horovod's docs and examples write theirs; these helpers only print
JSON lines for the test (``emit``), fingerprint the final weights (``digest``) and hold the ring
at a commit while the test's hold file exists (``hold_here``, from ``COMPAT_HOLD_FILE`` and
``COMPAT_HOLD_AT`` in the environment), so that a SIGKILL and the restarted process's return
land mid-training however slow the machine.
"""

import hashlib
import json
import os

import hold_file
import numpy as np
import tensorflow as tf


def emit(event, **fields):
    """One JSON line: the event, this process's pid and slot, and ``fields``."""
    record = {"event": event, "pid": os.getpid(), "slot": os.environ.get("HOROVOD_HOSTNAME")}
    print(json.dumps({**record, **fields}), flush=True)


def digest(weights):
    """A fingerprint of the weights' exact bytes (equal on every rank of a synchronous ring)."""
    hashed = hashlib.sha256()
    for weight in weights:
        hashed.update(np.ascontiguousarray(np.asarray(weight)).tobytes())
    return hashed.hexdigest()[:16]


def hold_here(state, hvd, step, *, check=True):
    """Hold at this commit (from step COMPAT_HOLD_AT on) while the test's hold file exists."""
    path = os.environ.get("COMPAT_HOLD_FILE")
    if not path or step < int(os.environ.get("COMPAT_HOLD_AT", "1")):
        return
    hold_file.hold(
        state,
        path,
        agree=lambda wanted: float(hvd.allreduce(tf.constant(wanted), name="compat_hold")),
        size=hvd.size,
        report=lambda event, _: emit(event, size=hvd.size(), rank=hvd.rank(), step=step),
        check=check,
    )
