"""Benchmark workload: a plain Horovod elastic TF2 script that reports every step.

Each step allreduces the gradients of a small dense model (about --params parameters) and
prints {"event": "step", "step": S, "size": N, "rank": R} on rank-local stdout; commits every
--commit-every steps. Also prints {"event": "init"} once hvd.init() returned and {"event":
"reset"} after every re-initialisation, so a benchmark can tell where a resize spends its time.
With --report-steps, also counts every step with elastic_allreduce.progress.report_step(step)
(what ElasticData and the Keras feed do), as a script would for elastic-run's hang watchdog.
With --summaries (implies --report-steps), also what ea.State does for TensorBoard: attaches
rank 0's summaries (elastic_allreduce.training.tensorboard; they write only when the job has a
--tensorboard-dir), marks the ring at the start and after every reset, and passes each step's
global batch and loss (a scalar tensor, as a custom loop would) to report_step.
With --warm-up, gives its step to elastic_allreduce.warm_up (a warm joiner under
`elastic-run --warm-join` traces it before it joins; elsewhere nothing); with --ea-state, the
state is elastic_allreduce.State instead of Horovod's TensorFlowKerasState; with --ea-tape, the
gradient tape is elastic_allreduce.DistributedGradientTape (the launcher's straggler watch reads
its wait in the allreduce).
Runs unchanged under `elastic-run`, `horovodrun` (static or elastic).
"""

import argparse
import itertools
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
parser.add_argument(
    "--summaries",
    action="store_true",
    help="attach rank 0's TensorBoard summaries as ea.State does, and report each step's "
    "samples and loss (implies --report-steps)",
)
parser.add_argument(
    "--warm-up", action="store_true", help="give the step to elastic_allreduce.warm_up"
)
parser.add_argument(
    "--ea-state", action="store_true", help="elastic_allreduce.State instead of Horovod's"
)
parser.add_argument(
    "--ea-tape",
    action="store_true",
    help="elastic_allreduce.DistributedGradientTape (times its wait in the allreduce: the "
    "launcher's straggler watch needs it) instead of Horovod's",
)
args = parser.parse_args()
args.report_steps = args.report_steps or args.summaries

if args.report_steps:
    # Only the progress module: it does not import TensorFlow (or the rest of the library).
    from elastic_allreduce.progress import report_step
if args.summaries:
    from elastic_allreduce.training import tensorboard


def emit(event, **fields):
    record = {"event": event, **fields, "size": hvd.size(), "rank": hvd.rank()}
    print(json.dumps(record), flush=True)


hvd.init()
emit("init")
optimizer = tf.keras.optimizers.SGD(0.001)
model, features = dense_model(args.params, args.batch, hvd.rank(), optimizer)
if args.ea_tape:
    from elastic_allreduce.training.api import DistributedGradientTape as tape_class
else:
    tape_class = hvd.DistributedGradientTape
train_step = train_step_fn(model, optimizer, features, tape_class, return_loss=args.summaries)
if args.warm_up:
    from elastic_allreduce.training.warm import warm_up

    warm_up(train_step)
# None without --summaries, or when the job has no --tensorboard-dir.
summaries = tensorboard.attach(tensorboard.learning_rate_of(optimizer)) if args.summaries else None
epochs = itertools.count()  # the ring epochs this process trained in, from 0


def mark_ring(cause):
    """Rank 0's marker at the step the ring trains from (ea.State's start and reset)."""
    epoch = next(epochs)
    if summaries is not None:
        summaries.ring(rank=hvd.rank(), size=hvd.size(), epoch=epoch, step=state.step, cause=cause)


def on_reset():
    emit("reset")
    mark_ring("resize")


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        loss = train_step()
        state.step += 1
        if args.summaries:
            report_step(state.step, samples=args.batch * hvd.size(), metrics={"loss": loss})
        elif args.report_steps:
            report_step(state.step)
        emit("step", step=state.step)
        if state.step % args.commit_every == 0:
            state.commit()


if args.ea_state:
    import elastic_allreduce as ea

    state = ea.State(model, optimizer, step=0)
else:
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
state.register_reset_callbacks([on_reset])
mark_ring(None)
train(state)
