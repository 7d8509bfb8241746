"""A plain Horovod elastic script (no elastic_allreduce) that builds its model but, unlike
Horovod's examples, runs no warm-up step: its Adam optimizer has no variables until the first
training step. A restarted process therefore joins with fewer optimizer variables than the
survivors -- the state sync that deadlocks under horovodrun.

Trains until ``--stop-file`` exists (checked by all ranks together at every commit) and prints
{"event": "commit"|"done", "step", "size", "rank", "slot", "checksum", "opt_checksum"}.
``--extra-layer-on-rank R`` gives rank R's model one layer more (a script whose ranks disagree).
"""

import argparse
import json
import os
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--stop-file", required=True)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--extra-layer-on-rank", type=int, default=-1)
args = parser.parse_args()

hvd.init()
data = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
targets = data.sum(axis=1, keepdims=True) * 3.0
layers = [tf.keras.layers.Dense(4, activation="tanh")]
if hvd.rank() == args.extra_layer_on_rank:
    layers.append(tf.keras.layers.Dense(4, activation="tanh"))
model = tf.keras.Sequential([*layers, tf.keras.layers.Dense(1)])
model.build((None, 4))
optimizer = tf.keras.optimizers.Adam(0.01)  # no optimizer.build(...), no warm-up step


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(data) - targets))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def total(variables) -> float:
    return round(sum(float(tf.reduce_sum(tf.cast(v, tf.float64))) for v in variables), 6)


def optimizer_variables():
    """A method in Keras 2, a property in Keras 3."""
    variables = optimizer.variables
    return variables() if callable(variables) else variables


def report(event: str, state) -> None:
    record = {
        "event": event,
        "step": state.step,
        "size": hvd.size(),
        "rank": hvd.rank(),
        "slot": os.environ.get("HOROVOD_HOSTNAME"),
        "checksum": total(model.variables),
        "opt_checksum": total(optimizer_variables()),
    }
    print(json.dumps(record), flush=True)


@hvd.elastic.run
def train(state):
    while True:
        train_step()
        state.step += 1
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()
            report("commit", state)
            wanted = 1.0 if os.path.exists(args.stop_file) else 0.0
            if float(hvd.allreduce(tf.constant(wanted), op=hvd.Sum)) > 0:
                return


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
train(state)
report("done", state)
