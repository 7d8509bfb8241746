"""Pattern d: a script's own collectives beside the training step.

``hvd.broadcast_object`` (a configuration chosen by rank 0, before the elastic run and at each
epoch), ``hvd.allgather_object`` (each rank's view of the epoch) and ``hvd.allreduce`` of a
metric (the mean loss), inside the elastic function.
"""

import argparse

import compat_events
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batches-per-epoch", type=int, default=10)
args = parser.parse_args()

hvd.init()
config = hvd.broadcast_object({"lr": 0.05, "seed": 11}, root_rank=0)

rng = np.random.default_rng(config["seed"])
features = rng.normal(size=(256, 5)).astype("float32")
targets = features @ rng.normal(size=(5, 1)).astype("float32")
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 5))
opt = tf.optimizers.SGD(config["lr"])
opt.build(model.trainable_variables)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        plan = hvd.broadcast_object({"epoch": state.epoch, "shuffle": state.epoch * 7}, 0)
        order = np.random.default_rng(plan["shuffle"]).permutation(len(features))
        losses = []
        while state.batch < args.batches_per_epoch:
            index = order[state.batch * 16 : (state.batch + 1) * 16]
            losses.append(float(train_step(features[index], targets[index])))
            state.batch += 1
            state.commit()
            compat_events.hold_here(state, hvd, state.epoch * args.batches_per_epoch + state.batch)
        mean_loss = float(hvd.allreduce(tf.constant(np.mean(losses or [0.0])), name="mean_loss"))
        views = hvd.allgather_object({"rank": hvd.rank(), "epoch": plan["epoch"]})
        compat_events.emit(
            "epoch", epoch=state.epoch, size=hvd.size(), loss=mean_loss, views=len(views)
        )
        state.epoch += 1
        state.batch = 0
        state.commit()


state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0, batch=0)
train(state)
compat_events.emit("done", size=hvd.size(), digest=compat_events.digest(model.get_weights()))
