"""Exactly-once data under elastic_allreduce: ElasticData over arrays, records or TFRecords.

--source picks where the samples come from (in-memory arrays, an indexable record collection,
or TFRecord shards this process writes to a private temporary directory); --keras trains with
``model.fit`` and ElasticData's Keras feed instead of a custom loop. Trains a linear model
(zero-initialised) on synthetic regression data for --epochs data epochs or --steps steps,
whichever comes first; prints a JSON "commit" line per commit and, at the end,
{"event": "done", "loss": L, "weights": [...]} with L the mean squared error over the whole
dataset computed in float64 from the final weights. With ELASTIC_ALLREDUCE_SAMPLE_LOG set, every
rank writes the sample audit log that `python -m elastic_allreduce.training.audit` checks. With
``--hold-file F`` the custom loop waits at its commits while F exists, taking membership changes
meanwhile (tests/scripts/hold_file.py): a test lets a joiner in before the data runs out.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import hold_file
import numpy as np
import tensorflow as tf
import tiny_model
from regression import regression_data

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=600)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
parser.add_argument("--batch-per-rank", type=int, default=4)
parser.add_argument("--global-batch", type=int, default=None)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.03)
parser.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate")
parser.add_argument("--scale-lr", action="store_true", help="learning rate --lr-per-rank x ranks")
parser.add_argument("--lr-per-rank", type=float, default=0.05)
parser.add_argument("--source", choices=("arrays", "records", "tfrecords"), default="arrays")
parser.add_argument("--keras", action="store_true", help="train with model.fit")
parser.add_argument("--hold-file", help="the custom loop waits at its commits while it exists")
args = parser.parse_args()

ea.init()
features, labels = regression_data(args.samples)
options = {"batch_per_rank": args.batch_per_rank, "global_batch": args.global_batch, "seed": 9}


class Rows:
    """An indexable record collection: only what ElasticData.from_records needs."""

    def __len__(self):
        return len(features)

    def __getitem__(self, index):
        return features[index], labels[index]


def write_shards(directory: Path, shards: int) -> list[np.ndarray]:
    """Contiguous blocks of the samples as TFRecord files, so that record id i is sample i."""
    blocks = np.array_split(np.arange(len(features)), shards)
    for k, block in enumerate(blocks):
        with tf.io.TFRecordWriter(str(directory / f"part-{k}.tfrecord")) as writer:
            for i in block:
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=features[i])),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=labels[i])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
    return blocks


def parse(serialized):
    spec = {
        "x": tf.io.FixedLenFeature([5], tf.float32),
        "y": tf.io.FixedLenFeature([1], tf.float32),
    }
    parsed = tf.io.parse_example(serialized, spec)
    return parsed["x"], parsed["y"]


scratch = Path(tempfile.mkdtemp(prefix="ea-data-"))
if args.source == "arrays":
    data = ea.ElasticData(features, labels, **options)
elif args.source == "records":
    data = ea.ElasticData.from_records(Rows(), **options)
else:
    blocks = write_shards(scratch, 3)
    paths = [scratch / f"part-{k}.tfrecord" for k in range(3)]
    counts = [len(block) for block in blocks]
    data = ea.ElasticData.from_tfrecords(paths, parse, counts=counts, **options)

model, optimizer, train_step = tiny_model.linear(inputs=5, learning_rate=args.lr)


def finished(state) -> bool:
    return state.epoch >= args.epochs or (args.steps is not None and state.step >= args.steps)


resize = ea.ScaleLearningRate(optimizer, args.lr_per_rank) if args.scale_lr else None
state = ea.State(model, optimizer, on_resize=resize, epoch=0, position=0, step=0)


def report_commit():
    record = {"event": "commit", "step": state.step, "size": ea.size(), "rank": ea.rank()}
    record["lr"] = round(float(optimizer.learning_rate.numpy()), 6)
    print(json.dumps(record), flush=True)


class Report(tf.keras.callbacks.Callback):
    """After the feed's callback: commit lines, the step delay and the --steps limit."""

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            report_commit()
        if finished(state):
            self.model.stop_training = True


def train_keras(state):
    while not finished(state):
        feed = data.keras_feed(state, commit_every=args.commit_every)
        if feed.steps:
            model.fit(feed.dataset, callbacks=[feed.callback, Report()], verbose=0)
        if finished(state):
            if state.step % args.commit_every:
                state.commit()
                report_commit()
            return
        data.next_epoch(state)
        state.commit()


if args.keras:
    model.compile(loss="mse", optimizer=ea.DistributedOptimizer(optimizer))


@ea.run
def train(state):
    if args.keras:
        train_keras(state)
        return
    while not finished(state):
        for batch in data.batches(state):
            train_step(batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32))
            data.advance(state, batch)
            time.sleep(args.step_delay)
            if state.step % args.commit_every == 0 or finished(state):
                state.commit()
                report_commit()
                if args.hold_file and not finished(state):
                    hold_file.hold(
                        state,
                        args.hold_file,
                        agree=lambda wanted: float(ea.allreduce(tf.constant(wanted))),
                        size=ea.size,
                        report=lambda event, _: print(json.dumps({"event": event}), flush=True),
                    )
            if finished(state):
                return
        data.next_epoch(state)
        state.commit()


train(state)
shutil.rmtree(scratch, ignore_errors=True)
kernel, bias = (v.numpy().astype("float64") for v in model.variables)
loss = float(np.mean((features.astype("float64") @ kernel + bias - labels) ** 2))
weights = [*kernel.ravel().tolist(), *bias.ravel().tolist()]
done = {"event": "done", "step": state.step, "size": ea.size(), "rank": ea.rank()}
print(json.dumps({**done, "loss": loss, "weights": weights}), flush=True)
