"""A custom training loop on ElasticData that hands its loss to the library each step
(``data.advance(state, batch, metrics={"loss": ...})``): what rank 0 writes to TensorBoard with
``--tensorboard-dir``. Prints a JSON "commit" line per commit and "done" at the end, as
ea_data.py does.
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf
import tiny_model

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=2400)
parser.add_argument("--batch-per-rank", type=int, default=4)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.03)
args = parser.parse_args()

ea.init()
rng = np.random.default_rng(3)
features = rng.normal(size=(args.samples, 5)).astype("float32")
labels = (features @ rng.normal(size=(5, 1))).astype("float32")
data = ea.ElasticData(features, labels, batch_per_rank=args.batch_per_rank, seed=9)

model, optimizer, train_step = tiny_model.linear(inputs=5)


state = ea.State(model, optimizer, epoch=0, position=0, step=0)


def report(event):
    record = {"event": event, "step": state.step, "size": ea.size(), "rank": ea.rank()}
    print(json.dumps(record), flush=True)


@ea.run
def train(state):
    for batch in data.batches(state):
        loss = train_step(batch.features, batch.labels, tf.constant(batch.loss_scale))
        data.advance(state, batch, metrics={"loss": float(loss) / ea.size()})
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()
            report("commit")
    state.commit()


train(state)
report("done")
