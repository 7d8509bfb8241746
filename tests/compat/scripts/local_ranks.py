"""Pattern f: ``hvd.local_rank()`` / ``hvd.local_size()`` for device pinning and for work done
once per node.

Horovod's GPU recipe pins ``gpus[hvd.local_rank()]`` (nothing to pin on a CPU machine); the
local rank 0 of each node prepares the node's data once (a marker file in ``--node-dir``, named
after this process); every commit reports the local rank and size the process reads.
"""

import argparse
import os

import compat_events
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--node-dir", required=True)
args = parser.parse_args()

hvd.init()
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
compat_events.emit("start", local_rank=hvd.local_rank(), local_size=hvd.local_size())

if hvd.local_rank() == 0:
    # Once per node: e.g. download and unpack the node's copy of the data.
    marker = os.path.join(args.node_dir, f"prepared-by-{os.getpid()}")
    with open(marker, "w") as handle:
        handle.write(f"{hvd.local_rank()} of {hvd.local_size()}\n")

rng = np.random.default_rng(5)
features = rng.normal(size=(64, 4)).astype("float32")
targets = features.sum(axis=1, keepdims=True)
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 4))
opt = tf.optimizers.SGD(0.01)
opt.build(model.trainable_variables)


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(features) - targets))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        train_step()
        state.step += 1
        state.commit()
        compat_events.emit(
            "commit",
            step=state.step,
            size=hvd.size(),
            rank=hvd.rank(),
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
        )
        compat_events.hold_here(state, hvd, state.step)


state = hvd.elastic.TensorFlowKerasState(model, opt, step=0)
train(state)
compat_events.emit(
    "done",
    size=hvd.size(),
    local_rank=hvd.local_rank(),
    local_size=hvd.local_size(),
    digest=compat_events.digest(model.get_weights()),
)
