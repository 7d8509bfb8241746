"""Exactly-once data under elastic_allreduce: ElasticData over in-memory arrays.

Trains a linear model (zero-initialised) on synthetic regression data for --epochs data epochs
or --steps steps, whichever comes first; prints a JSON "commit" line per commit and, at the
end, {"event": "done", "loss": L, "weights": [...]} with L the mean squared error over the
whole dataset computed in float64 from the final weights. With ELASTIC_ALLREDUCE_SAMPLE_LOG
set, every rank writes the sample audit log that `python -m elastic_allreduce.audit` checks.
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
parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
parser.add_argument("--batch-per-rank", type=int, default=4)
parser.add_argument("--global-batch", type=int, default=None)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.03)
parser.add_argument("--scale-lr", action="store_true", help="learning rate 0.05 x ranks")
args = parser.parse_args()

ea.init()
rng = np.random.default_rng(3)
features = rng.normal(size=(args.samples, 5)).astype("float32")
noise = 0.1 * rng.normal(size=(args.samples, 1))
labels = (features @ rng.normal(size=(5, 1)) + noise).astype("float32")
data = ea.ElasticData(
    features, labels, batch_per_rank=args.batch_per_rank, global_batch=args.global_batch, seed=9
)

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


def finished(state) -> bool:
    return state.epoch >= args.epochs or (args.steps is not None and state.step >= args.steps)


resize = ea.ScaleLearningRate(optimizer, 0.05) if args.scale_lr else None
state = ea.State(model, optimizer, on_resize=resize, epoch=0, position=0, step=0)


@ea.run
def train(state):
    while not finished(state):
        for batch in data.batches(state):
            train_step(batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32))
            data.advance(state, batch)
            time.sleep(args.step_delay)
            if state.step % args.commit_every == 0 or finished(state):
                state.commit()
                record = {"event": "commit", "step": state.step, "size": ea.size()}
                record["rank"] = ea.rank()
                record["lr"] = round(float(optimizer.learning_rate.numpy()), 6)
                print(json.dumps(record), flush=True)
            if finished(state):
                return
        data.next_epoch(state)
        state.commit()


train(state)
kernel, bias = (v.numpy().astype("float64") for v in model.variables)
loss = float(np.mean((features.astype("float64") @ kernel + bias - labels) ** 2))
weights = [*kernel.ravel().tolist(), *bias.ravel().tolist()]
done = {"event": "done", "step": state.step, "size": ea.size(), "rank": ea.rank()}
print(json.dumps({**done, "loss": loss, "weights": weights}), flush=True)
