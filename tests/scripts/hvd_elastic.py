"""A TF2 training script written only against Horovod's elastic API (no elastic_allreduce).

It trains a small linear model on fixed data and, at every commit, prints one JSON line:
{"event": "commit", "step": S, "size": N, "rank": R, "checksum": C}. At the end it prints
{"event": "done", ..., "steps_run": K} where K counts the steps this process executed: more
than its share means some steps were rolled back and run again. The first time the training
function runs in a process past step 0 (the state synced from a peer or, under elastic-run,
loaded from the slot's snapshot in shared memory), it prints {"event": "resumed", ...}.
``--wait-for-snapshot`` prints a commit only once it is in the slot's snapshot (the method
elastic-run adds to Horovod's state; nothing outside elastic-run). With ``--hold-file F`` the
ring waits at each commit from step ``--hold-at`` on while F exists, taking membership changes
meanwhile and printing {"event": "held", "size": N, ...} once per size: a test lets a slow
joiner in before the fixed number of steps runs out, however loaded the machine.
"""

import argparse
import json
import os
import time

import hold_file
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--wait-for-snapshot", action="store_true")
parser.add_argument("--hold-file")
parser.add_argument("--hold-at", type=int, default=1)
args = parser.parse_args()

hvd.init()
rng = np.random.default_rng(0)
features = rng.normal(size=(64, 8)).astype("float32")
labels = features @ np.arange(1, 9, dtype="float32")[:, None]

model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(8,))])
optimizer = tf.keras.optimizers.SGD(0.01)
model.build((None, 8))
optimizer.build(model.trainable_variables)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


def checksum() -> float:
    return float(sum(float(tf.reduce_sum(v)) for v in model.variables))


steps_run = [0]
started = [False]


def report(event: str, state) -> None:
    print(
        json.dumps(
            {
                "event": event,
                "step": state.step,
                "size": hvd.size(),
                "rank": hvd.rank(),
                "slot": os.environ.get("HOROVOD_HOSTNAME"),
                "checksum": round(checksum(), 6),
                "steps_run": steps_run[0],
            }
        ),
        flush=True,
    )


@hvd.elastic.run
def train(state):
    if not started[0]:
        started[0] = True
        if state.step > 0:
            report("resumed", state)
    while state.step < args.steps:
        on_commit = state.step % args.commit_every == 0
        if args.hold_file and on_commit and state.step >= args.hold_at:
            hold_file.hold(
                state,
                args.hold_file,
                agree=lambda wanted: float(hvd.allreduce(tf.constant(wanted), name="held")),
                size=hvd.size,
                report=report,
            )
        train_step(features, labels)
        state.step += 1
        steps_run[0] += 1
        if args.step_delay:
            time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()
            if args.wait_for_snapshot and hasattr(state, "wait_for_snapshot"):
                state.wait_for_snapshot()
            report("commit", state)


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
state.register_reset_callbacks(
    [lambda: print(json.dumps({"event": "reset", "size": hvd.size()}), flush=True)]
)
train(state)
report("done", state)
