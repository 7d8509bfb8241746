"""Which gradient allreduces the collective clock times (one process, real Horovod at size 1).

Prints one JSON line: for ea's tape and optimizer, and -- with the bootstrap's hooks installed --
Horovod's own (its Keras optimizer: "refused" around a Keras 3 optimizer), whether a training
step moved the clock (elastic_allreduce.training.collective_clock:
the [ready, done] timestamps of the last gradient allreduce), and whether timing twice wraps once.
"""

import json

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf

import elastic_allreduce as ea
from elastic_allreduce.bootstrap import hooks
from elastic_allreduce.errors import ConfigError
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from elastic_allreduce.training import collective_clock

ea.init()
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)


def model():
    built = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    built.build((None, 4))
    return built


def clock_moved(step):
    """Run ``step``; whether the clock's "done" timestamp moved (None: no clock yet)."""
    clock = collective_clock._clock
    before = None if clock is None else float(clock.numpy()[1])
    step()
    clock = collective_clock._clock
    if clock is None:
        return False
    return float(clock.numpy()[1]) != before and collective_clock.last_wait() is not None


def custom_loop(tape_class):
    net, optimizer = model(), tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(net(x) - y))
        gradients = tape_class(tape).gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(gradients, net.trainable_variables, strict=True))

    return step


def keras_fit(make_optimizer):
    net = model()
    net.compile(optimizer=make_optimizer(tf.keras.optimizers.SGD(0.1)), loss="mse")
    return lambda: net.fit(x, y, batch_size=8, epochs=1, verbose=0)


results = {
    "horovod_tape_before_hooks": clock_moved(custom_loop(hvd.DistributedGradientTape)),
    "ea_tape": clock_moved(custom_loop(ea.DistributedGradientTape)),
    "ea_optimizer_fit": clock_moved(keras_fit(ea.DistributedOptimizer)),
}
with EmbeddedEtcd() as etcd, EtcdStore(etcd.endpoints_text, "clock") as store:
    hooks.install(store)
    results["horovod_tape"] = clock_moved(custom_loop(hvd.DistributedGradientTape))
    try:
        moved = clock_moved(keras_fit(hvd_keras.DistributedOptimizer))
    except ConfigError as refused:  # Keras 3: Horovod's wrapper would never reduce
        moved = "refused" if "cannot wrap a Keras 3 optimizer" in str(refused) else str(refused)
    results["horovod_keras_optimizer_fit"] = moved
    tape = ea.DistributedGradientTape(tf.GradientTape())  # Horovod's, timed, then ea's
    wrapped = tape._allreduce_grads
    results["timed_once"] = collective_clock.timed(tape)._allreduce_grads is wrapped
print(json.dumps(results))
