"""Pattern a: a custom training loop, as Horovod's TF2 elastic example writes it.

The step is a ``tf.function`` that wraps its tape in ``hvd.DistributedGradientTape`` only when
``allreduce=True``; it is first called once with ``allreduce=False`` to build the optimizer
(Horovod's documented warm-up, before the elastic run). The state is a
``TensorFlowKerasState``, committed every batch; a reset callback rescales the learning rate
to the ring's size.
"""

import argparse

import compat_events
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=60)
args = parser.parse_args()

hvd.init()
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

rng = np.random.default_rng(0)
images = rng.normal(size=(512, 8, 8, 1)).astype("float32")
labels = rng.integers(0, 4, size=512)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(32)

model = tf.keras.Sequential(
    [
        tf.keras.layers.Conv2D(4, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(4, activation="softmax"),
    ]
)
loss = tf.losses.SparseCategoricalCrossentropy()
lr = 0.001
opt = tf.optimizers.Adam(lr * hvd.size())


@tf.function
def training_step(images, labels, allreduce=True):
    with tf.GradientTape() as tape:
        probs = model(images, training=True)
        loss_value = loss(labels, probs)
    if allreduce:
        tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss_value


# Horovod: initialize model and optimizer state so they can be synchronized across workers.
for images_batch, labels_batch in dataset.take(1):
    training_step(images_batch, labels_batch, allreduce=False)


@hvd.elastic.run
def train(state):
    for images_batch, labels_batch in dataset.skip(state.batch).take(args.batches - state.batch):
        training_step(images_batch, labels_batch)
        state.batch += 1
        state.commit()
        compat_events.hold_here(state, hvd, state.batch)


def on_state_reset():
    opt.learning_rate.assign(lr * hvd.size())
    compat_events.emit("reset", size=hvd.size(), lr=float(opt.learning_rate.numpy()))


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
compat_events.emit(
    "done", size=hvd.size(), step=state.batch, digest=compat_events.digest(model.get_weights())
)
