"""A TF2 training script on elastic_allreduce's API (State with checkpoints, progress).

Prints one JSON line per commit ({"event": "commit", "step", "size", "rank", "checksum"}),
"resumed" when it starts from a checkpoint, and "done" at the end (with "steps_run": the steps
this process executed; more than its share means steps were rolled back and run again).
``--hold-file`` and ``--hold-at`` hold the ring at its commits as in hvd_elastic.py.
"""

import argparse
import time

import hold_file
import tensorflow as tf
import tiny_model

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--checkpoint-every", type=int, default=2, help="in commits")
parser.add_argument("--hold-file")
parser.add_argument("--hold-at", type=int, default=1)
args = parser.parse_args()

ea.init()
model, optimizer, step_fn = tiny_model.build()

steps_run = [0]


def emit(event, state):
    tiny_model.emit(event, state, model, steps_run=steps_run[0])


state = ea.State(model, optimizer, checkpoint_every=args.checkpoint_every, step=0)
if state.step > 0:
    emit("resumed", state)


@ea.run
def train(state):
    while state.step < args.steps:
        on_commit = state.step % args.commit_every == 0
        if args.hold_file and on_commit and state.step >= args.hold_at:
            hold_file.hold(
                state,
                args.hold_file,
                agree=lambda wanted: float(ea.allreduce(tf.constant(wanted))),
                size=ea.size,
                report=emit,
            )
        step_fn()
        state.step += 1
        steps_run[0] += 1
        time.sleep(args.step_delay)
        if state.step % args.commit_every == 0:
            state.commit()
            # A commit line means the commit is in shared memory too (written on a thread).
            state.wait_for_snapshot()
            emit("commit", state)


train(state)
emit("done", state)
