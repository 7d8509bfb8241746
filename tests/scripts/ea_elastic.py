"""A TF2 training script on elastic_allreduce's API (State with checkpoints, progress).

Prints one JSON line per commit ({"event": "commit", "step", "size", "rank", "checksum"}),
"resumed" when it starts from a checkpoint, and "done" at the end (with "steps_run": the steps
this process executed; more than its share means steps were rolled back and run again).
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--checkpoint-every", type=int, default=2, help="in commits")
args = parser.parse_args()

ea.init()
data = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
targets = data.sum(axis=1, keepdims=True) * 3.0

model = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(1)])
model.build((None, 4))
optimizer = tf.keras.optimizers.Adam(0.01)
optimizer.build(model.trainable_variables)


@tf.function
def step_fn():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(data) - targets))
    gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))


steps_run = [0]


def emit(event, state):
    weights = sum(float(tf.reduce_sum(v)) for v in model.variables)
    record = {"event": event, "step": state.step, "size": ea.size(), "rank": ea.rank()}
    record.update(checksum=round(weights, 6), slot=os.environ.get("HOROVOD_HOSTNAME"))
    record["steps_run"] = steps_run[0]
    print(json.dumps(record), flush=True)


state = ea.State(model, optimizer, checkpoint_every=args.checkpoint_every, step=0)
if state.step > 0:
    emit("resumed", state)


@ea.run
def train(state):
    while state.step < args.steps:
        step_fn()
        state.step += 1
        steps_run[0] += 1
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()
            emit("commit", state)


train(state)
emit("done", state)
