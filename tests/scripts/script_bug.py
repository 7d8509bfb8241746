"""A plain Horovod elastic script with a bug that the test chooses (issue #39, item 3).

It trains a small model, committing every step, and raises ``ValueError("bad batch at step S")``
at step ``--fail-at`` -- on every rank, or only on the slot ``--fail-slot`` -- in the
incarnations ``--fail-incarnations`` (``all``, or a number: only that one). With
``--wait-for-size N`` the ring waits at its commits after that step until it has N ranks again
(a restarted process is back, however slow its start). At the end it prints
{"event": "done", "step": S, "checksum": C, ...}.
"""

import argparse
import json
import os
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--fail-at", type=int, default=3)
parser.add_argument("--fail-slot", default="all")
parser.add_argument("--fail-incarnations", default="all")
parser.add_argument("--step-delay", type=float, default=0.05)
parser.add_argument("--wait-for-size", type=int, default=0)
args = parser.parse_args()

hvd.init()
slot = os.environ.get("HOROVOD_HOSTNAME")
incarnation = os.environ.get("ELASTIC_ALLREDUCE_INCARNATION", "1")
features = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
labels = features.sum(axis=1, keepdims=True)
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 4))
optimizer = tf.keras.optimizers.SGD(0.01)
optimizer.build(model.trainable_variables)


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(features) - labels))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def fails_here(step):
    return (
        step == args.fail_at
        and args.fail_slot in ("all", slot)
        and args.fail_incarnations in ("all", incarnation)
    )


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        if fails_here(state.step):
            raise ValueError(f"bad batch at step {state.step}")
        train_step()
        state.step += 1
        state.commit()
        time.sleep(args.step_delay)
        while state.step > args.fail_at and hvd.size() < args.wait_for_size:
            time.sleep(0.05)
            state.check_host_updates()  # the joiner's notification interrupts the wait


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
train(state)
checksum = float(sum(float(tf.reduce_sum(v)) for v in model.variables))
print(
    json.dumps({"event": "done", "step": state.step, "slot": slot, "checksum": round(checksum, 6)})
)
