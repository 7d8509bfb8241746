"""ea.State's snapshots in one process (real TensorFlow and Horovod, size 1).

``python ea_snapshots.py SNAPSHOT_DIR CHECKPOINT_ROOT`` (ELASTIC_ALLREDUCE_SNAPSHOT_DIR set to
SNAPSHOT_DIR): each commit is snapshotted (keeping one); a new State loads the newer of the
snapshot and the newest checkpoint by commit id; with too little shared memory (a fake free
space) snapshots are skipped with one warning; a full device (ENOSPC) skips one with a warning.
Then the same for Horovod's own TensorFlowKerasState with the hooks' sync and commit: each
commit snapshotted, a new state's first sync loads it.
Prints one JSON line of results; the warnings go to stderr.
"""

import errno
import json
import logging
import shutil
import sys
from pathlib import Path

import tensorflow as tf
import tiny_model
from horovod.tensorflow.elastic import TensorFlowKerasState

import elastic_allreduce as ea
from elastic_allreduce.bootstrap import hooks
from elastic_allreduce.commits import checkpoint
from elastic_allreduce.commits import shm as shm_snapshot

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
snapshots = Path(sys.argv[1])
checkpoint_root = Path(sys.argv[2])
ea.init()
results = {}


def fresh(**kwargs):
    """A new model, optimizer and State (as in a new process)."""
    tf.keras.backend.clear_session()
    model, optimizer, step_fn = tiny_model.build()
    return step_fn, ea.State(model, optimizer, step=0, **kwargs)


def train(state, step_fn, steps):
    for _ in range(steps):
        step_fn()
        state.step += 1
        state.commit()
        assert state.wait_for_snapshot(30.0)  # written on the snapshot thread


def names():
    return sorted(p.name for p in snapshots.iterdir() if p.name.startswith("ckpt-"))


# Every commit snapshotted, the newest kept; a new State resumes from it.
step_fn, state = fresh()
train(state, step_fn, 3)
results["written"] = names()
step_fn, state = fresh()
results["resumed_step"] = state.step

# A checkpoint at commit 5 (newer than the snapshot of commit 4) wins; then the snapshot does.
step_fn, state = fresh()
train(state, step_fn, 1)  # commit 4, snapshot only
step_fn, state = fresh(checkpoint_dir=checkpoint_root, checkpoint_every=5)
train(state, step_fn, 1)  # commit 5: snapshot and checkpoint
snapshots_before = names()
for entry in snapshots.iterdir():  # the snapshot back to an older commit: the checkpoint wins
    if entry.name.startswith("ckpt-"):
        meta = json.loads((entry / "meta.json").read_text())
        meta["attributes"]["commit_id"] = 1
        meta["attributes"]["step"] = 1
        (entry / "meta.json").write_text(json.dumps(meta))
        entry.rename(entry.with_name(entry.name.replace("commit-000000005", "commit-000000001")))
step_fn, state = fresh(checkpoint_dir=checkpoint_root, checkpoint_every=5)
results["checkpoint_wins_step"] = state.step
train(state, step_fn, 2)  # commits 6, 7: snapshots only (the next checkpoint is at 10)
step_fn, state = fresh(checkpoint_dir=checkpoint_root, checkpoint_every=5)
results["snapshot_wins_step"] = state.step

# Too little shared memory: skipped, one warning for the process.
real_free_bytes = shm_snapshot.free_bytes
shm_snapshot.free_bytes = lambda path, statvfs=None: 1024
before = names()
train(state, step_fn, 2)
results["unchanged_when_small"] = names() == before
shm_snapshot.free_bytes = real_free_bytes
train(state, step_fn, 1)
results["after_small"] = names()

# A full device while writing: that snapshot skipped with a warning, training goes on.
real_write_file = checkpoint._write_file


def full(path, write, *, exclusive=True):
    raise OSError(errno.ENOSPC, "No space left on device")


checkpoint._write_file = full
train(state, step_fn, 1)
checkpoint._write_file = real_write_file
results["after_enospc"] = names()
results["step"] = state.step

# Horovod's own state with the hooks' methods (as the bootstrap installs them): each commit
# snapshotted too, and a new process's first sync loads it. (A new folder's worth: the same
# model's ea.State snapshot has the same fingerprint.)
shutil.rmtree(snapshots)
snapshots.mkdir()
TensorFlowKerasState.sync = hooks._sync
TensorFlowKerasState.commit = hooks._commit
TensorFlowKerasState.check_host_updates = hooks._check_host_updates
TensorFlowKerasState.wait_for_snapshot = hooks._wait_for_snapshot


def fresh_horovod():
    tf.keras.backend.clear_session()
    model, optimizer, step_fn = tiny_model.build()
    return model, step_fn, TensorFlowKerasState(model, optimizer, step=0)


model, step_fn, horovod_state = fresh_horovod()
horovod_state.sync()  # nothing to load
for _ in range(3):
    step_fn()
    horovod_state.step += 1
    horovod_state.commit()
    assert horovod_state.wait_for_snapshot(30.0)
results["horovod_written"] = names()
committed = tiny_model.checksum(model.variables)
step_fn()  # past the commit: not in the snapshot
model, step_fn, horovod_state = fresh_horovod()
initial = tiny_model.checksum(model.variables)
horovod_state.sync()
results["horovod_resumed"] = {
    "step": horovod_state.step,
    "commit_id": getattr(horovod_state, hooks._COMMIT_ID),
    "committed_weights": tiny_model.checksum(model.variables) == committed != initial,
    "attributes": horovod_state._saved_state,
}
print(json.dumps(results))
