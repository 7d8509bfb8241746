"""A fixed global batch gives the single-process update at any number of ranks.

Trains a linear model for --steps steps with ElasticData(global_batch=G) and prints
{"event": "done", "loss": L, "weights": [...]} where L is the mean squared error over the
whole dataset, computed in float64 from the final weights.
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--global-batch", type=int, default=24)
parser.add_argument("--step-delay", type=float, default=0.0)
args = parser.parse_args()

ea.init()
rng = np.random.default_rng(3)
features = rng.normal(size=(240, 5)).astype("float32")
labels = (features @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(240, 1))).astype("float32")
data = ea.ElasticData(features, labels, global_batch=args.global_batch, seed=9)

model = tf.keras.Sequential([tf.keras.layers.Dense(1, kernel_initializer="zeros")])
model.build((None, 5))
optimizer = tf.keras.optimizers.SGD(0.1)
optimizer.build(model.trainable_variables)


@tf.function
def train_step(x, y, loss_scale):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x) - y)) * loss_scale
    gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))


state = ea.State(model, optimizer, epoch=0, position=0, step=0)


@ea.run
def train(state):
    while state.step < args.steps:
        for batch in data.batches(state):
            train_step(batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32))
            data.advance(state, batch)
            time.sleep(args.step_delay)
            state.commit()
            print(
                json.dumps(
                    {"event": "commit", "step": state.step, "size": ea.size(), "rank": ea.rank()}
                ),
                flush=True,
            )
            if state.step >= args.steps:
                break
        else:
            data.next_epoch(state)


train(state)
kernel, bias = (v.numpy().astype("float64") for v in model.variables)
loss = float(np.mean((features.astype("float64") @ kernel + bias - labels) ** 2))
weights = [*kernel.ravel().tolist(), *bias.ravel().tolist()]
print(
    json.dumps({"event": "done", "loss": loss, "weights": weights, "size": ea.size()}), flush=True
)
