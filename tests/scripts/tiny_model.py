"""The small regression model that the elastic test scripts train, and their JSON reports.

Imported by scripts next to it (the bootstrap puts a script's folder first on sys.path).
"""

import json
import os

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea


def build(warmup=True):
    """(model, optimizer, step_fn): the same data and initial weights on every rank.

    With ``warmup=False`` the optimizer creates its variables only at its first step (as in a
    script without Horovod's warm-up step)."""
    data = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
    targets = data.sum(axis=1, keepdims=True) * 3.0
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(1)]
    )
    model.build((None, 4))
    optimizer = tf.keras.optimizers.Adam(0.01)
    if warmup:
        optimizer.build(model.trainable_variables)

    @tf.function
    def step_fn():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(data) - targets))
        gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))

    return model, optimizer, step_fn


def linear(inputs, learning_rate=0.1):
    """(model, optimizer, train_step): a linear model from zeros, SGD, and a step on a batch of
    ElasticData (``train_step(x, y, loss_scale)`` returns the scaled summed squared error)."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, kernel_initializer="zeros")])
    model.build((None, inputs))
    optimizer = tf.keras.optimizers.SGD(learning_rate)
    optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(x, y, loss_scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) * loss_scale
        gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    return model, optimizer, train_step


def checksum(variables):
    """The sum of every value of ``variables`` (equal on ranks that hold the same state)."""
    return round(sum(float(tf.reduce_sum(tf.cast(v, tf.float64))) for v in variables), 6)


def optimizer_checksum(optimizer):
    """checksum() of the optimizer's variables (a method on Keras 2, a property on Keras 3)."""
    variables = optimizer.variables
    return checksum(variables() if callable(variables) else variables)


def emit(event, state, model, **extra):
    """Print {"event", "step", "size", "rank", "checksum", "slot", ...extra} as one line."""
    weights = sum(float(tf.reduce_sum(v)) for v in model.variables)
    record = {"event": event, "step": state.step, "size": ea.size(), "rank": ea.rank()}
    record.update(checksum=round(weights, 6), slot=os.environ.get("HOROVOD_HOSTNAME"), **extra)
    print(json.dumps(record), flush=True)
