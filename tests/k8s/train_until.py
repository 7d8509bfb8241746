"""A TF2 training script on elastic_allreduce's API that trains until a stop file appears.

Every ``--commit-every`` steps it commits, prints {"event": "commit", "step", "size", "rank",
"checksum", "slot"} and asks all ranks (one allreduce) whether ``--stop-file`` exists, so every
rank stops after the same commit; then it prints "done". The test decides when training ends
instead of guessing a number of steps that outlasts its fault schedule.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--stop-file", required=True)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--max-steps", type=int, default=100_000)
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


def emit(event, state):
    weights = sum(float(tf.reduce_sum(v)) for v in model.variables)
    record = {"event": event, "step": state.step, "size": ea.size(), "rank": ea.rank()}
    record.update(checksum=round(weights, 6), slot=os.environ.get("HOROVOD_HOSTNAME"))
    print(json.dumps(record), flush=True)


state = ea.State(model, optimizer, step=0)


@ea.run
def train(state):
    while state.step < args.max_steps:
        step_fn()
        state.step += 1
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()
            emit("commit", state)
            wanted = 1.0 if os.path.exists(args.stop_file) else 0.0
            if float(ea.allreduce(tf.constant(wanted))) > 0:
                return


train(state)
emit("done", state)
