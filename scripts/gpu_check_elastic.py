"""gpu-check's elastic job (run by ``elastic-run``; scripts/gpu_check.py): a small regression
model trained with elastic_allreduce on the GPUs, Adam jit-compiled by XLA as TensorFlow 2.15
does on a GPU (so libdevice and ptxas must be found). At ``--kill-at-step`` the process of rank 1
SIGKILLs itself, once; the job must restore the last commit, take the restarted process back
and finish with the same weights on every rank. Training goes on past ``--steps`` (slowly) until
the ring has ``--expect-size`` processes again, so that the restarted one always rejoins.

Each event is one line ``GPU_CHECK_RESULT {json}``: ``start`` (the process's GPUs: how many it
sees, which TensorFlow computes on, the agent's index), ``kill``, ``commit`` and ``done``.
``--share-gpu``: the processes share one GPU, each under its own NCCL host id (NCCL refuses two
ranks of one host on one device). ``--cpu``: the plumbing only, without GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--kill-at-step", type=int, default=20)
parser.add_argument("--expect-size", type=int, default=2)
parser.add_argument("--max-steps", type=int, default=5000, help="give up waiting for a rejoin")
parser.add_argument("--share-gpu", action="store_true")
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

slot = os.environ.get("ELASTIC_ALLREDUCE_SLOT", "-")
incarnation = int(os.environ.get("ELASTIC_ALLREDUCE_INCARNATION", "1"))
if args.share_gpu:
    os.environ["NCCL_HOSTID"] = f"gpu-check-{slot}"


def emit(event: str, **fields: object) -> None:
    record = {"event": event, "slot": slot, "incarnation": incarnation, **fields}
    print("GPU_CHECK_RESULT " + json.dumps(record), flush=True)


visible = [d.name for d in tf.config.get_visible_devices("GPU")]
index = os.environ.get("ELASTIC_ALLREDUCE_GPU_INDEX")
emit(
    "start",
    physical_gpus=len(tf.config.list_physical_devices("GPU")),
    visible=visible,
    gpu_index=int(index) if index else None,
    # The GPU TensorFlow computes on, by its index among the physical ones (the bootstrap chose
    # it before this script ran: elastic_allreduce.bootstrap.gpu).
    selected=int(visible[0].rsplit(":", 1)[1]) if len(visible) == 1 else None,
)

ea.init()
data = np.random.default_rng(1).normal(size=(256, 32)).astype("float32")
targets = data.sum(axis=1, keepdims=True)
model = tf.keras.Sequential(
    [tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(1)]
)
model.build((None, 32))
optimizer = tf.keras.optimizers.Adam(0.01)
optimizer.build(model.trainable_variables)


@tf.function
def step_fn() -> tf.Tensor:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(data) - targets))
    gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
    return loss


def checksum() -> float:
    return round(sum(float(tf.reduce_sum(tf.cast(v, tf.float64))) for v in model.variables), 6)


state = ea.State(model, optimizer, step=0)


@ea.run
def train(state: ea.State) -> None:
    while (state.step < args.steps or ea.size() < args.expect_size) and (
        state.step < args.max_steps
    ):
        if ea.size() < args.expect_size:
            time.sleep(0.05)  # short-handed: wait (training on) for the restarted process
        if state.step == args.kill_at_step and ea.rank() == 1 and incarnation == 1:
            emit("kill", step=state.step)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = step_fn()
        state.step += 1
        if state.step % args.commit_every == 0:
            state.commit()
            emit("commit", step=state.step, size=ea.size(), rank=ea.rank(), loss=float(loss))


train(state)
emit(
    "done",
    step=state.step,
    size=ea.size(),
    rank=ea.rank(),
    checksum=checksum(),
    device=model.variables[0].device,
)
