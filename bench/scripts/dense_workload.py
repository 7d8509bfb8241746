"""The model the benchmark scripts train: two dense layers of about ``params`` parameters.

Shared by hvd_steps.py and state_cost.py (the scripts' directory is on sys.path under both
elastic-run and horovodrun).
"""

import numpy as np
import tensorflow as tf


def dense_model(params, batch, seed, optimizer):
    """A built model, its built optimizer, and a fixed batch of features for this rank."""
    width = max(8, int((params / 2) ** 0.5))
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(width, activation="relu"), tf.keras.layers.Dense(width)]
    )
    model.build((None, width))
    optimizer.build(model.trainable_variables)
    features = np.random.default_rng(seed).normal(size=(batch, width)).astype("float32")
    return model, tf.constant(features)


def train_step_fn(model, optimizer, features, distributed_tape, return_loss=False):
    """A tf.function running one step on ``features``, gradients through ``distributed_tape``;
    it returns the step's loss (a scalar tensor) with ``return_loss``, else nothing."""

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(features)))
        tape = distributed_tape(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        if return_loss:
            return loss
        return None

    return train_step
