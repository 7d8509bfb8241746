"""Benchmark workload: what elastic_allreduce.State costs for models of several sizes.

Runs under `elastic-run`. For each size in --params, a dense model (Adam, so the state is the
weights and two moment slots) trains for --steps steps, committing every --commit-every steps,
then commits --extra-commits more times with each part of a commit timed alone. Rank 0 prints:

* {"event": "sync", ...}: State.sync() -- the broadcast of the committed state that a joiner
  receives -- timed after a barrier; the first one for each model runs on a ring that has not
  moved that model's tensors yet (what a joiner sees), the others repeat it;
* {"event": "summary", ...}: per model, step and commit times (medians), the parts of a commit
  (the in-memory save, rank 0's progress report to etcd, the host-update check), state bytes.
"""

import argparse
import gc
import json
import statistics
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from dense_workload import dense_model, train_step_fn

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--params", default="1000000", help="model sizes, comma-separated")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--commit-every", type=int, default=10)
parser.add_argument("--extra-commits", type=int, default=3)
parser.add_argument("--extra-syncs", type=int, default=2)
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()

ea.init()
barrier_value = tf.constant(1.0)


def emit(record):
    if ea.rank() == 0:
        print(json.dumps(record), flush=True)


def barrier():
    hvd.allreduce(barrier_value, name="bench.barrier", op=hvd.Sum)


def state_bytes(state):
    variables = [*state.model.variables, *state.optimizer.variables()]
    return int(sum(np.prod(v.shape) * v.dtype.size for v in variables))


def timed(function):
    barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


class TimedState(ea.State):
    def sync(self):
        seconds = timed(super().sync)
        emit({"event": "sync", "seconds": seconds, "bytes": state_bytes(self), "size": ea.size()})


def measure(params):
    optimizer = tf.keras.optimizers.Adam(0.0001)
    model, features = dense_model(params, args.batch, ea.rank(), optimizer)
    train_step = train_step_fn(model, optimizer, features, ea.DistributedGradientTape)

    @ea.run
    def train(state):
        steps, commits = [], []
        while state.step < args.steps:
            start = time.perf_counter()
            train_step()
            steps.append(time.perf_counter() - start)
            state.step += 1
            if state.step % args.commit_every == 0:
                start = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - start)
        parts = {"save": [], "report": [], "check": []}
        for _ in range(args.extra_commits):
            commits.append(timed(state.commit))
            parts["save"].append(timed(state.save))
            # Only rank 0 reports; every rank enters the barrier of timed().
            parts["report"].append(timed(state._report if ea.rank() == 0 else lambda: None))
            parts["check"].append(timed(state.check_host_updates))
        for _ in range(args.extra_syncs):
            state.sync()
        timed_steps = steps[2:] or steps  # the first steps trace the tf.function
        emit(
            {
                "event": "summary",
                "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
                "state_bytes": state_bytes(state),
                "size": ea.size(),
                "step_s": statistics.median(timed_steps),
                "commit_s": statistics.median(commits),
                "commit_s_max": max(commits),
                "commit_parts_s": {name: statistics.median(v) for name, v in parts.items()},
                "commits": len(commits),
                "steps": len(timed_steps),
                "commit_every": args.commit_every,
            }
        )

    train(TimedState(model, optimizer, step=0))


for size in (int(p) for p in args.params.split(",")):
    measure(size)
    gc.collect()
