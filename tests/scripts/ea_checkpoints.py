"""ea.State's checkpoints in one process (real TensorFlow and Horovod, size 1).

``python ea_checkpoints.py ROOT``: writes, resumes, falls back past a truncated checkpoint,
refuses another model's checkpoint, survives failed writes and refuses a bad
--keep-checkpoints, each as a new process would
(``clear_session`` gives the next model the same variable names). Prints one JSON line of
results; the warnings go to stderr.
"""

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
import tiny_model

import elastic_allreduce as ea
from elastic_allreduce.errors import ConfigError

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
root = Path(sys.argv[1])
folder = root / os.environ.get("ELASTIC_ALLREDUCE_JOB_ID", "default")
ea.init()
results = {}


def fresh(**kwargs):
    """A new model, optimizer and State (as in a new process)."""
    tf.keras.backend.clear_session()
    model, optimizer, step_fn = tiny_model.build()
    return model, step_fn, ea.State(model, optimizer, checkpoint_every=1, step=0, **kwargs)


def train(state, step_fn, steps):
    for _ in range(steps):
        step_fn()
        state.step += 1
        state.commit()


# Every commit is checkpointed; --keep-checkpoints (the environment) says how many stay.
model, step_fn, state = fresh(checkpoint_dir=root)
train(state, step_fn, 4)
results["written"] = sorted(p.name for p in folder.iterdir())
trained = [v.numpy() for v in model.variables]

model, _, state = fresh(checkpoint_dir=root)
results["resumed_step"] = state.step
results["resumed_weights_equal"] = all(
    np.array_equal(a, v.numpy()) for a, v in zip(trained, model.variables, strict=True)
)

newest = sorted(p for p in folder.iterdir() if p.name.startswith("ckpt-"))[-1]
arrays = newest / "arrays.npz"
arrays.write_bytes(arrays.read_bytes()[: arrays.stat().st_size // 2])
_, _, state = fresh(checkpoint_dir=root)
results["fallback_step"] = state.step

tf.keras.backend.clear_session()
other = tf.keras.Sequential([tf.keras.layers.Dense(3), tf.keras.layers.Dense(1)])
other.build((None, 4))
other_optimizer = tf.keras.optimizers.Adam(0.01)
other_optimizer.build(other.trainable_variables)
state = ea.State(other, other_optimizer, checkpoint_dir=root, checkpoint_every=1, step=0)
results["other_model_step"] = state.step

# A job folder that cannot be created: every write fails, and training goes on.
blocked = root / "blocked"
blocked.mkdir()
(blocked / folder.name).write_text("in the way")
_, step_fn, state = fresh(checkpoint_dir=blocked)
train(state, step_fn, 2)
results["steps_after_failed_writes"] = state.step

os.environ["ELASTIC_ALLREDUCE_KEEP_CHECKPOINTS"] = "0"
try:
    fresh(checkpoint_dir=root)
except ConfigError as exc:
    results["bad_keep"] = str(exc)
print(json.dumps(results), flush=True)
