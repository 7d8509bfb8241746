"""How ea.run and Horovod's hvd.elastic.run treat TensorFlow errors (one process, real Horovod).

Prints one JSON line: what each wrapper did with an UnknownError that does not come from a
collective, and whether ea.run retried after one that does.
"""

import json

import tensorflow as tf
from horovod.tensorflow.elastic import run as horovod_run

import elastic_allreduce as ea

ea.init()
model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
model.build((None, 2))
optimizer = tf.keras.optimizers.SGD(0.1)
optimizer.build(model.trainable_variables)
state = ea.State(model, optimizer, step=0)


def not_a_collective(state):
    raise tf.errors.UnknownError(None, None, "reading a shard failed: Input/output error")


def outcome(run):
    try:
        return repr(run(not_a_collective)(state))
    except tf.errors.UnknownError:
        return "raised"


attempts = []


def a_peer_dies_once(state):
    attempts.append(state.step)
    if len(attempts) == 1:
        state.step = 5  # not committed: rolled back before the retry
        raise tf.errors.UnknownError(
            None,
            None,
            "{{node loss_sum}} [gloo/transport/tcp/pair.cc:589] Read error: Connection reset by "
            "peer",
        )
    return "trained"


retried = ea.run(a_peer_dies_once)(state)
print(
    json.dumps(
        {
            "horovod": outcome(horovod_run),
            "elastic_allreduce": outcome(ea.run),
            "retried": retried,
            "attempts": attempts,
        }
    ),
    flush=True,
)
