"""The plain-data collectives of a state at 2 ranks (real Horovod over Gloo, `horovodrun -np 2`).

Each rank prints one line `RESULT {...}`: what each case did on it. The cases: a sync from the
rank with the newest commit (attributes as JSON, NumPy scalars converted), host-update
notifications that reached one rank only (every rank interrupts at the same commit), a non-plain
attribute on one rank at a commit and at a sync (every rank raises StateValueError), a
malformed (pickled) payload from the sync's root (every rank raises ProtocolError; the pickle is
never loaded), and Horovod's own TensorFlowKerasState with the hooks' sync and commit (which
also syncs from the rank with the newest commit).

    python plain_collectives.py MARKER_DIR
"""

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
import tiny_model
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult
from horovod.tensorflow.elastic import TensorFlowKerasState

import elastic_allreduce as ea
from elastic_allreduce import env
from elastic_allreduce.agreement import plain, sync
from elastic_allreduce.bootstrap import hooks
from elastic_allreduce.errors import ProtocolError, StateValueError

# What each commit's vote decides: here every commit votes (batching: tests/test_host_votes.py).
os.environ[env.HOST_CHECK_INTERVAL] = "0"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers.pickles import Exploit

marker_dir = Path(sys.argv[1])
ea.init()
rank = ea.rank()
results = {"rank": rank}


def outcome(function):
    """What calling ``function`` did: "ok", "interrupt(skip_sync)" or the error's type and text."""
    try:
        function()
    except HostsUpdatedInterrupt as exc:
        return f"interrupt({exc.skip_sync})"
    except (StateValueError, ProtocolError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def no_pickles(obj, root_rank=0):
    raise AssertionError(f"Horovod's broadcast_object was called with {obj!r}")


# -- ea.State ------------------------------------------------------------------------------------
model, optimizer, step_fn = tiny_model.build()
results["tuple_at_construction"] = outcome(lambda: ea.State(model, optimizer, when=(1, 2)))
state = ea.State(model, optimizer, step=np.int64(0), history=[], meta={"rank": rank})
results["no_bcast_object"] = state._bcast_object.__name__
state.commit()
if rank == 1:  # rank 1 committed twice more, with its own values: the newest commit
    state.step = 7
    state.history = [np.float32(0.5)]
    state.commit_id = 3
    state.save()  # no collective: only commit() checks for host updates
state.sync()
results["synced"] = state._saved_state
results["types"] = [type(state.step).__name__, type(state.history[0]).__name__]

# A notification that reached rank 1 only: both ranks interrupt, and sync (an addition).
if rank == 1:
    state.on_hosts_updated(5, HostUpdateResult.added)
results["added_on_rank_1"] = outcome(state.commit)
# A removal that reached rank 0 only: both interrupt and skip the sync (removals only).
if rank == 0:
    state.on_hosts_updated(6, HostUpdateResult.removed)
results["removed_on_rank_0"] = outcome(state.commit)
# An old notification (a resend) changes nothing.
state.on_hosts_updated(4, HostUpdateResult.added)
results["stale"] = outcome(state.commit)
results["last_updated"] = state._last_updated_timestamp

# A tuple on rank 1 at a commit: both ranks raise, neither hangs; then training goes on.
if rank == 1:
    state.history = (1, 2)
results["tuple_on_rank_1_at_commit"] = outcome(state.commit)
state.history = []
results["commit_after"] = outcome(state.commit)

# The root's attributes are not plain data at a sync: both ranks raise.
results["tuple_at_root_sync"] = outcome(
    lambda: sync.broadcast_attributes({"x": (1,) if rank == 0 else []}, 0)
)
# The root sends a pickle instead of JSON: both ranks refuse it, nobody loads it.
marker = marker_dir / f"pickle-ran-on-rank-{rank}"
honest_encode = plain.encode_attributes
if rank == 0:
    plain.encode_attributes = lambda attributes: pickle.dumps({"step": Exploit(marker)})
results["pickle_from_root"] = outcome(lambda: sync.broadcast_attributes({"step": 1}, 0))
plain.encode_attributes = honest_encode
results["marker_exists"] = marker.exists()

# -- Horovod's own state with the hooks' methods (as the bootstrap installs them) ------------
state_class = TensorFlowKerasState
state_class.sync = hooks._sync
state_class.commit = hooks._commit
state_class.check_host_updates = hooks._check_host_updates
model, optimizer, step_fn = tiny_model.build()
horovod_state = TensorFlowKerasState(model, optimizer, batch=rank, epoch=np.int32(2))
horovod_state._bcast_object = no_pickles
results["horovod_sync"] = outcome(horovod_state.sync)
results["horovod_synced"] = horovod_state._saved_state
if rank == 1:
    horovod_state.on_hosts_updated(9, HostUpdateResult.added)
results["horovod_added_on_rank_1"] = outcome(horovod_state.commit)
results["horovod_commit_after"] = outcome(horovod_state.commit)
# Rank 1 holds a newer commit (as if loaded from its snapshot): the sync takes rank 1's state,
# variables and attributes and commit count, not rank 0's (ea.State's rule).
if rank == 1:
    model.variables[0].assign_add(tf.ones_like(model.variables[0]))
    horovod_state.batch = 5
    horovod_state.save()
    setattr(horovod_state, hooks._COMMIT_ID, 99)
results["horovod_checksum_before"] = tiny_model.checksum(model.variables)
results["horovod_newest_sync"] = outcome(horovod_state.sync)
results["horovod_newest_synced"] = horovod_state._saved_state
results["horovod_newest_commit_id"] = getattr(horovod_state, hooks._COMMIT_ID)
results["horovod_newest_checksum"] = tiny_model.checksum(model.variables)

print("RESULT " + json.dumps(results), flush=True)
