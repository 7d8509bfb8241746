"""Ranks that see different data must end every step with the same weights.

Each rank trains a linear model on data drawn from its own rank (so a rank that trained alone
would drift away from the others), by a custom loop (``--mode loop``: a gradient tape) or by
Keras ``fit`` (``--mode fit``: a wrapped optimizer), through ``--wrapper``: ``ea`` (the
elastic_allreduce API), ``horovod`` (Horovod's own classes) or ``none`` (no averaging at all:
the control that shows the test can tell). Prints {"event": "step", "step", "rank", "size",
"checksum", "loss"} after every step and {"event": "done", ...} at the end.
"""

import argparse
import json

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("loop", "fit"), required=True)
parser.add_argument("--wrapper", choices=("ea", "horovod", "none"), default="ea")
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

ea.init()
rng = np.random.default_rng(1000 + ea.rank())
x = rng.normal(size=(8 * args.steps, 4)).astype("float32")
y = rng.normal(loc=float(ea.rank()), size=(8 * args.steps, 1)).astype("float32")
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 4))


def report(step, loss):
    checksum = sum(float(tf.reduce_sum(v)) for v in model.trainable_variables)
    record = {
        "event": "step",
        "step": step,
        "rank": ea.rank(),
        "size": ea.size(),
        "checksum": round(checksum, 6),
        "loss": float(loss),
    }
    print(json.dumps(record), flush=True)


def optimizer_for_fit():
    optimizer = tf.keras.optimizers.SGD(0.05)
    if args.wrapper == "ea":
        return ea.DistributedOptimizer(optimizer)
    if args.wrapper == "horovod":
        return hvd_keras.DistributedOptimizer(optimizer)
    return optimizer


def tape_for_loop(tape):
    if args.wrapper == "ea":
        return ea.DistributedGradientTape(tape)
    if args.wrapper == "horovod":
        return hvd.DistributedGradientTape(tape)
    return tape


class Report(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        report(batch + 1, (logs or {}).get("loss", float("nan")))


if args.mode == "fit":
    optimizer = optimizer_for_fit()
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    state = ea.State(model, optimizer, step=0)
    state.sync()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, callbacks=[Report()], verbose=0)
else:
    optimizer = tf.keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)
    state = ea.State(model, optimizer, step=0)
    state.sync()

    @tf.function
    def train_step(features, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(features) - targets))
        gradients = tape_for_loop(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    for step in range(args.steps):
        batch = slice(8 * step, 8 * step + 8)
        report(step + 1, train_step(x[batch], y[batch]))

print(json.dumps({"event": "done", "rank": ea.rank()}), flush=True)
