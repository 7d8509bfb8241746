"""Benchmark workload: a plain Horovod elastic TF2 script that reports every step.

Each step allreduces the gradients of a small dense model (about --params parameters) and
prints {"event": "step", "step": S, "size": N, "rank": R} on rank-local stdout; commits every
--commit-every steps. Runs unchanged under `elastic-run`, `horovodrun` (static or elastic).
"""

import argparse
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--commit-every", type=int, default=10)
parser.add_argument("--params", type=int, default=1_000_000)
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()

hvd.init()
width = max(8, int((args.params / 2) ** 0.5))
model = tf.keras.Sequential(
    [tf.keras.layers.Dense(width, activation="relu"), tf.keras.layers.Dense(width)]
)
model.build((None, width))
optimizer = tf.keras.optimizers.SGD(0.001)
optimizer.build(model.trainable_variables)
rng = np.random.default_rng(hvd.rank())
features = tf.constant(rng.normal(size=(args.batch, width)).astype("float32"))


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(features)))
    tape = hvd.DistributedGradientTape(tape)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        train_step()
        state.step += 1
        print(
            json.dumps(
                {"event": "step", "step": state.step, "size": hvd.size(), "rank": hvd.rank()}
            ),
            flush=True,
        )
        if state.step % args.commit_every == 0:
            state.commit()


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
train(state)
