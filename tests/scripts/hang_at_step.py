"""A training script that hangs on purpose, for the launcher's hang watchdog.

Trains the tiny model (ea.State, a step count reported with ea.report_step) for ``--steps``
steps, committing every ``--commit-every`` and printing {"event": "commit"|"done", ...}; with
``--stop-file FILE`` it trains on past ``--steps`` until FILE exists (asked of every rank with
one allreduce at each commit from ``--steps`` on, so all stop after the same commit): the test
decides when training ends. Faults:

* ``--sleep-at-step N --sleep-rank R``: rank R sleeps in Python (outside any collective) before
  step N; with ``--once FILE`` only the first process to get there does (it creates FILE);
* ``--slow-first-step S``: every process's first step takes S seconds longer;
* ``--slow-eval-at-step N --slow-eval S``: an evaluation marked with ``ea.phase`` takes S seconds
  on every rank at step N (once per process);
* ``--hog-gil-at-step N --hog-gil S``: every rank holds the GIL for S seconds before step N (once
  per process), its other threads stalled -- as TensorFlow's import or a long trace does.
"""

import argparse
import os
import sys
import time

import tensorflow as tf
import tiny_model

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--sleep-at-step", type=int)
parser.add_argument("--sleep-rank", type=int, default=1)
parser.add_argument("--once")
parser.add_argument("--stop-file")
parser.add_argument("--slow-first-step", type=float, default=0.0)
parser.add_argument("--slow-eval-at-step", type=int)
parser.add_argument("--slow-eval", type=float, default=0.0)
parser.add_argument("--hog-gil-at-step", type=int)
parser.add_argument("--hog-gil", type=float, default=0.0)
args = parser.parse_args()

ea.init()
model, optimizer, step_fn = tiny_model.build()
state = ea.State(model, optimizer, step=0)
evaluated = []
hogged = []


def hang_here():
    """Whether this rank sleeps now (the fault), and never returns if so."""
    if args.once is not None:
        try:
            os.close(os.open(args.once, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    print(f"rank {ea.rank()} sleeps at step {state.step}", flush=True)
    while True:
        time.sleep(3600)


def hog_gil(seconds):
    """Busy in Python for ``seconds`` without letting another thread of this process run."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60.0)  # no thread switch while this loop runs
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            pass
    finally:
        sys.setswitchinterval(interval)
    print(f"rank {ea.rank()} held the GIL for {time.monotonic() - start:.1f} s", flush=True)


def stopped():
    """Whether every rank is done: past --steps and, with --stop-file, the file exists."""
    if state.step < args.steps:
        return False
    if args.stop_file is None:
        return True
    wanted = 1.0 if os.path.exists(args.stop_file) else 0.0
    return float(ea.allreduce(tf.constant(wanted))) > 0


@ea.run
def train(state):
    first = True
    while state.step < args.steps or args.stop_file is not None:
        if state.step == args.sleep_at_step and ea.rank() == args.sleep_rank:
            hang_here()
        if first and args.slow_first_step:
            time.sleep(args.slow_first_step)
        first = False
        if state.step == args.hog_gil_at_step and not hogged:
            hogged.append(state.step)
            hog_gil(args.hog_gil)
        step_fn()
        state.step += 1
        ea.report_step(state.step, total=args.steps)
        time.sleep(args.step_delay)
        if state.step == args.slow_eval_at_step and not evaluated:
            evaluated.append(state.step)
            with ea.phase("evaluation"):
                time.sleep(args.slow_eval)
            ea.allreduce(tf.constant(1.0))  # every rank finished its evaluation
        if state.step % args.commit_every == 0:
            state.commit()
            tiny_model.emit("commit", state, model)
            if stopped():
                return


train(state)
tiny_model.emit("done", state, model)
