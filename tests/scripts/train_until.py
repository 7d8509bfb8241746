"""A TF2 training script on elastic_allreduce's API that trains until a stop file appears.

Every ``--commit-every`` steps it commits, prints {"event": "commit", "step", "size", "rank",
"checksum", "opt_checksum", "slot"} and asks all ranks (one allreduce) whether ``--stop-file``
exists, so every rank stops after the same commit; then it prints "done". The test decides when
training ends instead of guessing a number of steps that outlasts its fault schedule.
With TEST_SETUP_DELAY=S in its environment a process takes S seconds more to set up (a slow
model build); the step is given to ea.warm_up (a warm joiner traces it before it joins).
"""

import argparse
import os
import time

import tensorflow as tf
import tiny_model

import elastic_allreduce as ea

parser = argparse.ArgumentParser()
parser.add_argument("--stop-file", required=True)
parser.add_argument("--commit-every", type=int, default=5)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--max-steps", type=int, default=100_000)
parser.add_argument("--no-warmup", action="store_true", help="no optimizer.build before State")
args = parser.parse_args()

ea.init()
time.sleep(float(os.environ.get("TEST_SETUP_DELAY", "0")))
model, optimizer, step_fn = tiny_model.build(warmup=not args.no_warmup)
ea.warm_up(step_fn)


def emit(event, state):
    tiny_model.emit(event, state, model, opt_checksum=tiny_model.optimizer_checksum(optimizer))


state = ea.State(model, optimizer, step=0)


@ea.run
def train(state):
    while state.step < args.max_steps:
        step_fn()
        state.step += 1
        time.sleep(args.step_delay)
        ea.report_step(state.step)  # step times: the launcher's straggler watch
        if state.step % args.commit_every == 0:
            state.commit()
            emit("commit", state)
            wanted = 1.0 if os.path.exists(args.stop_file) else 0.0
            if float(ea.allreduce(tf.constant(wanted))) > 0:
                return


train(state)
emit("done", state)
