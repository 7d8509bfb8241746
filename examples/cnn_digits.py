"""A CNN on the handwritten digits that ship with scikit-learn, trained elastically.

Runs alone (`python examples/cnn_digits.py`) or under `elastic-run` with any number of ranks;
workers may join, leave or die while it trains. Each sample of each epoch is used exactly once
(ea.ElasticData), with a fixed global batch so the result does not depend on the ranks.
The last line it prints is `final test accuracy: <x>`.

Your own data: --data FILE.npz with arrays x_train, y_train, x_test, y_test (images HxW or
HxWxC, integer labels).
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--global-batch", type=int, default=64)
parser.add_argument("--learning-rate", type=float, default=0.003)
parser.add_argument("--commit-every", type=int, default=5, help="steps between commits")
parser.add_argument("--data", help="an .npz file with x_train, y_train, x_test, y_test")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument(
    "--min-epoch-seconds",
    type=float,
    default=0.0,
    help="an epoch lasts at least this long (a demo's pace: joins and kills land mid-training)",
)
parser.add_argument(
    "--hold-file",
    help="past --epochs, go on training more epochs while this file exists (at most "
    "4 x --epochs; the ranks agree at each epoch's end): a demo's way to keep the job training "
    "until its joins and kills have happened, however slow the machine",
)
args = parser.parse_args()


def held(epoch: int) -> bool:
    """Whether to train another epoch past --epochs: every rank asks, in one allreduce, whether
    the hold file exists (so all of them decide alike)."""
    if not args.hold_file or epoch >= 4 * args.epochs:
        return False
    wanted = 1.0 if os.path.exists(args.hold_file) else 0.0
    return float(ea.allreduce(tf.constant(wanted))) > 0


def load() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if args.data:
        with np.load(args.data) as stored:
            arrays = [stored[name] for name in ("x_train", "y_train", "x_test", "y_test")]
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(42).permutation(len(digits.images))
        images, labels = digits.images[order], digits.target[order]
        split = int(0.8 * len(images))
        arrays = [images[:split], labels[:split], images[split:], labels[split:]]
    x_train, y_train, x_test, y_test = arrays
    scale = float(max(x_train.max(), 1.0))

    def prepare(x: np.ndarray) -> np.ndarray:
        x = x.astype("float32") / scale
        return x[..., None] if x.ndim == 3 else x

    return prepare(x_train), y_train.astype("int64"), prepare(x_test), y_test.astype("int64")


ea.init()
tf.keras.utils.set_random_seed(args.seed)
x_train, y_train, x_test, y_test = load()
classes = int(max(y_train.max(), y_test.max())) + 1
model = tf.keras.Sequential(
    [
        tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        tf.keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(classes),
    ]
)
model.build((None, *x_train.shape[1:]))
optimizer = tf.keras.optimizers.Adam(args.learning_rate)
optimizer.build(model.trainable_variables)
data = ea.ElasticData(x_train, y_train, global_batch=args.global_batch, seed=args.seed)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


@tf.function
def train_step(x, y, loss_scale):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) * loss_scale
    gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
    return loss


def accuracy(x: np.ndarray, y: np.ndarray) -> float:
    predictions = np.argmax(model.predict(x, batch_size=256, verbose=0), axis=1)
    return float(np.mean(predictions == y))


state = ea.State(model, optimizer, epoch=0, position=0, step=0)


@ea.run
def train(state):
    while state.epoch < args.epochs or held(state.epoch):
        began = time.monotonic()
        for batch in data.batches(state):
            train_step(batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32))
            data.advance(state, batch)
            if state.step % args.commit_every == 0:
                state.commit()
        data.next_epoch(state)
        state.commit()
        if ea.rank() == 0:
            report = {"epoch": state.epoch, "step": state.step, "ranks": ea.size()}
            report["test_accuracy"] = round(accuracy(x_test, y_test), 4)
            print(json.dumps(report), flush=True)
        time.sleep(max(0.0, args.min_epoch_seconds - (time.monotonic() - began)))


train(state)
print(f"final test accuracy: {accuracy(x_test, y_test):.4f}", flush=True)
