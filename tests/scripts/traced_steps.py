"""The hooks inside a user's traced step (issue #39, item 1): Horovod's own DistributedGradientTape,
timed by the bootstrap's hooks, in the ways Horovod's docs and examples trace a step. One
process, real Horovod at size 1.

Prints one JSON line: for each way, whether the step ran and moved the collective clock.
- ``traced_before_init``: Horovod's documented warm-up -- the step's first trace without the
  tape wrapped (``allreduce=False``), then with it -- traced before ``hvd.init()`` (as
  elastic-run's processes trace: HOROVOD_ELASTIC=1), run after it. The clock's variable is
  first asked for during the second trace: the case that failed ("tf.function only supports
  singleton tf.Variables created on the first call");
- ``warm_up_first``: the same warm-up after ``hvd.init()``, run eagerly;
- ``retraced``: that function called with another batch shape (one more trace);
- ``second_function``: another traced function that wraps its own tape.
"""

import json
import os

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from elastic_allreduce.bootstrap import hooks
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from elastic_allreduce.training import collective_clock


def data(rows):
    x = np.random.default_rng(rows).normal(size=(rows, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def clock_moved(step):
    """Run ``step``; whether the clock's "done" timestamp moved."""
    clock = collective_clock._clock
    before = None if clock is None else float(clock.numpy()[1])
    step()
    clock = collective_clock._clock
    return clock is not None and float(clock.numpy()[1]) != before


def make_step(net, optimizer):
    @tf.function
    def step(x, y, allreduce=True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(x) - y))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(gradients, net.trainable_variables, strict=True))
        return loss

    return step


def model():
    built = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    built.build((None, 4))
    return built


results = {}
with EmbeddedEtcd() as etcd, EtcdStore(etcd.endpoints_text, "traced") as store:
    hooks.install(store)
    # Traced before init, as under elastic-run (the size is an op that runs with the step).
    early_net, early_optimizer = model(), tf.keras.optimizers.SGD(0.1)
    early_step = make_step(early_net, early_optimizer)
    x8, y8 = data(8)
    os.environ["HOROVOD_ELASTIC"] = "1"
    early_step.get_concrete_function(x8, y8, allreduce=False)
    early_step.get_concrete_function(x8, y8)
    del os.environ["HOROVOD_ELASTIC"]  # a ring of one of its own: no rendezvous at init
    hvd.init()
    results["traced_before_init"] = clock_moved(lambda: early_step(x8, y8))

    net, optimizer = model(), tf.keras.optimizers.SGD(0.1)
    step = make_step(net, optimizer)
    step(x8, y8, allreduce=False)  # Horovod's warm-up: builds the optimizer, no allreduce
    results["warm_up_first"] = clock_moved(lambda: step(x8, y8))
    x16, y16 = data(16)
    results["retraced"] = clock_moved(lambda: step(x16, y16))
    other_net, other_optimizer = model(), tf.keras.optimizers.SGD(0.1)
    other_step = make_step(other_net, other_optimizer)
    results["second_function"] = clock_moved(lambda: other_step(x8, y8))
    results["traces"] = step.experimental_get_tracing_count()
print(json.dumps(results))
