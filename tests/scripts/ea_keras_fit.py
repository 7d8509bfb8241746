"""Keras `model.fit` under elastic_allreduce: State plus the commit/batch/epoch callbacks.

Prints {"event": "epoch", "epoch": E, "size": N, "rank": R, "loss": L} at the end of each epoch and
{"event": "done", "checksum": C, ...} at the end.
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-delay", type=float, default=0.02)
args = parser.parse_args()

ea.init()
rng = np.random.default_rng(7)
x = rng.normal(size=(512, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1))).astype("float32")

model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(1)])
model.build((None, 6))
optimizer = tf.keras.optimizers.SGD(0.01)
model.compile(loss="mse", optimizer=ea.DistributedOptimizer(optimizer))
optimizer.build(model.trainable_variables)


class Report(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(args.batch_delay)

    def on_epoch_end(self, epoch, logs=None):
        record = {"event": "epoch", "epoch": epoch, "size": ea.size(), "rank": ea.rank()}
        record["loss"] = float((logs or {}).get("loss", float("nan")))
        print(json.dumps(record), flush=True)


state = ea.State(model, optimizer, batch=0, epoch=0)


@ea.run
def train(state):
    callbacks = [
        ea.CommitStateCallback(state, batches_per_commit=4),
        ea.UpdateBatchStateCallback(state),
        ea.UpdateEpochStateCallback(state),
        Report(),
    ]
    model.fit(
        x,
        y,
        batch_size=32,
        steps_per_epoch=16,
        epochs=args.epochs,
        initial_epoch=state.epoch,
        callbacks=callbacks,
        verbose=0,
    )


train(state)
checksum = sum(float(tf.reduce_sum(v)) for v in model.variables)
print(json.dumps({"event": "done", "checksum": round(checksum, 5), "size": ea.size()}), flush=True)
