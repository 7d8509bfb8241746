"""Benchmark workload: a plain Horovod elastic TF2 script that reports every step.

Each step allreduces the gradients of a small dense model (about --params parameters) and
prints {"event": "step", "step": S, "size": N, "rank": R} on rank-local stdout; commits every
--commit-every steps. Also prints {"event": "init"} once hvd.init() returned and {"event":
"reset"} after every re-initialisation, so a benchmark can tell where a resize spends its time.
With --report-steps, also counts every step with elastic_allreduce.progress.report_step(step)
(what ElasticData and the Keras feed do), as a script would for elastic-run's hang watchdog.
Runs unchanged under `elastic-run`, `horovodrun` (static or elastic).
"""

import argparse
import json

import horovod.tensorflow as hvd
import tensorflow as tf
from dense_workload import dense_model, train_step_fn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--commit-every", type=int, default=10)
parser.add_argument("--params", type=int, default=1_000_000)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument(
    "--report-steps",
    action="store_true",
    help="call elastic_allreduce.progress.report_step(step) after every step",
)
args = parser.parse_args()

if args.report_steps:
    # Only the progress module: it does not import TensorFlow (or the rest of the library).
    from elastic_allreduce.progress import report_step


def emit(event, **fields):
    record = {"event": event, **fields, "size": hvd.size(), "rank": hvd.rank()}
    print(json.dumps(record), flush=True)


hvd.init()
emit("init")
optimizer = tf.keras.optimizers.SGD(0.001)
model, features = dense_model(args.params, args.batch, hvd.rank(), optimizer)
train_step = train_step_fn(model, optimizer, features, hvd.DistributedGradientTape)


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        train_step()
        state.step += 1
        if args.report_steps:
            report_step(state.step)
        emit("step", step=state.step)
        if state.step % args.commit_every == 0:
            state.commit()


state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
state.register_reset_callbacks([lambda: emit("reset")])
train(state)
