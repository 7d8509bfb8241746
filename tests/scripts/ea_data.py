"""Exactly-once data under elastic_allreduce: ElasticData over in-memory arrays.

Trains a linear model for --epochs data epochs over --samples samples; prints a JSON "commit"
line per commit and "done" at the end. With ELASTIC_ALLREDUCE_SAMPLE_LOG set, every rank
writes the sample audit log that `python -m elastic_allreduce.audit` checks.
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=600)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-per-rank", type=int, default=4)
parser.add_argument("--global-batch", type=int, default=None)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.03)
args = parser.parse_args()

ea.init()
rng = np.random.default_rng(11)
features = rng.normal(size=(args.samples, 3)).astype("float32")
labels = (features @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")).astype("float32")
data = ea.ElasticData(
    features, labels, batch_per_rank=args.batch_per_rank, global_batch=args.global_batch, seed=5
)

model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 3))
optimizer = tf.keras.optimizers.SGD(0.05)
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
    while state.epoch < args.epochs:
        for batch in data.batches(state):
            train_step(batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32))
            data.advance(state, batch)
            time.sleep(args.step_delay)
            if state.step % args.commit_every == 0:
                state.commit()
                print(
                    json.dumps(
                        {
                            "event": "commit",
                            "step": state.step,
                            "size": ea.size(),
                            "rank": ea.rank(),
                        }
                    ),
                    flush=True,
                )
        data.next_epoch(state)
        state.commit()


train(state)
print(
    json.dumps({"event": "done", "step": state.step, "size": ea.size(), "rank": ea.rank()}),
    flush=True,
)
