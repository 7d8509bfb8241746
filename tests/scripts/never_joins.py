"""A script whose later processes never enter an elastic run (issue #39, item 4).

Its first processes train in ``hvd.elastic.run`` until the stop file exists; a restarted
process (incarnation 2 and later) does a little work of its own and ends without an elastic run,
as a script that trains outside one would: under --warm-join it never joined the ring.
"""

import argparse
import os
import time

import horovod.tensorflow as hvd
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--stop-file", required=True)
args = parser.parse_args()

hvd.init()
if os.environ.get("ELASTIC_ALLREDUCE_INCARNATION", "1") != "1":
    print(f"trained alone at size {hvd.size()}", flush=True)
    raise SystemExit(0)

model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 2))


@hvd.elastic.run
def train(state):
    while not os.path.exists(args.stop_file):
        hvd.allreduce(tf.constant(1.0), name="tick")
        state.step += 1
        state.commit()
        time.sleep(0.05)


state = hvd.elastic.TensorFlowKerasState(model, step=0)
train(state)
