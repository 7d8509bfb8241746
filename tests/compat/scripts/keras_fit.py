"""Pattern b: Keras ``fit``, as Horovod's TF2 Keras elastic example writes it.

``hvd.DistributedOptimizer``; one ``fit`` step before the state is made (the optimizer's
variables); ``hvd.elastic.KerasState``; the three state callbacks; a reset callback that sets
the learning rate and calls ``fit`` for one step again (to meet the ranks that join); a
``ModelCheckpoint`` on rank 0 only.
"""

import argparse
import os

import compat_events
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=12)
parser.add_argument("--checkpoint-dir", required=True)
args = parser.parse_args()

hvd.init()
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

rng = np.random.default_rng(1)
features = rng.normal(size=(384, 6)).astype("float32")
targets = features @ rng.normal(size=(6, 1)).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((features, targets)).repeat().batch(16)

model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(1)])
scaled_lr = 0.01 * hvd.size()
opt = hvd.DistributedOptimizer(tf.optimizers.SGD(scaled_lr))
model.compile(loss="mse", optimizer=opt, experimental_run_tf_function=False)

# Horovod: initialize the optimizer's state so that it can be synchronized across workers.
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    tf.keras.backend.set_value(state.model.optimizer.lr, 0.01 * hvd.size())
    # Re-initialize, to join with possible new ranks.
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)
    compat_events.emit("reset", size=hvd.size())


state.register_reset_callbacks([on_state_reset])


class Hold(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        compat_events.hold_here(state, hvd, state.epoch * args.steps_per_epoch + state.batch)


callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
    Hold(),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    path = os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.h5")
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(path))


@hvd.elastic.run
def train(state):
    state.model.fit(
        dataset,
        steps_per_epoch=args.steps_per_epoch,
        epochs=args.epochs - state.epoch,
        callbacks=callbacks,
        verbose=0,
    )


train(state)
compat_events.emit("done", size=hvd.size(), digest=compat_events.digest(model.get_weights()))
