"""A TF2 training script on elastic_allreduce's API (State with checkpoints, progress).

Prints one JSON line per commit ({"event": "commit", "step", "size", "rank", "checksum"}),
"resumed" when it starts from a checkpoint, and "done" at the end (with "steps_run": the steps
this process executed; more than its share means steps were rolled back and run again).
``--hold-file`` and ``--hold-at`` hold the ring at its commits as in hvd_elastic.py.
"""

import argparse
import os
import time

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


def held():
    """Whether any rank still sees the hold file (all ranks get the same answer)."""
    wanted = 1.0 if os.path.exists(args.hold_file) else 0.0
    return float(ea.allreduce(tf.constant(wanted))) > 0


def hold(state):
    """Wait at a commit while the hold file exists; a membership change interrupts it here."""
    shown = None
    while held():
        if shown != ea.size():
            shown = ea.size()
            emit("held", state)
        time.sleep(0.05)
        state.check_host_updates()


@ea.run
def train(state):
    while state.step < args.steps:
        on_commit = state.step % args.commit_every == 0
        if args.hold_file and on_commit and state.step >= args.hold_at:
            hold(state)
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
