"""Pattern e: how often a script commits -- once per epoch, or never.

A plain custom loop over epochs and batches. ``--commit epoch``: ``state.commit()`` at the end
of each epoch only, so a failure rolls back to the epoch's start. ``--commit never``: the state
is only ever what the elastic run synced, so a failure restarts training from there, and a
joiner is let in when the ring's resize times out (it never reaches a commit to hear of it).
"""

import argparse

import compat_events
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--commit", choices=["epoch", "never"], required=True)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batches-per-epoch", type=int, default=8)
args = parser.parse_args()

hvd.init()
rng = np.random.default_rng(3)
features = rng.normal(size=(128, 4)).astype("float32")
targets = features @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 4))
opt = tf.optimizers.SGD(0.02)
opt.build(model.trainable_variables)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        for batch in range(args.batches_per_epoch):
            index = slice(batch * 16, (batch + 1) * 16)
            train_step(features[index], targets[index])
            step = state.epoch * args.batches_per_epoch + batch + 1
            if args.commit == "never":
                compat_events.hold_here(state, hvd, step, check=False)
        state.epoch += 1
        if args.commit == "epoch":
            state.commit()
            compat_events.hold_here(state, hvd, state.epoch * args.batches_per_epoch)


state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0)
train(state)
compat_events.emit(
    "done", size=hvd.size(), epoch=state.epoch, digest=compat_events.digest(model.get_weights())
)
