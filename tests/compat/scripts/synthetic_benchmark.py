"""Pattern c: the shape of Horovod's elastic synthetic benchmark.

One training step with the tape wrapped -- an allreduce -- runs before the state is made ("to
initialize weights before synchronization"); inside the elastic function ``timeit`` loops of
that traced step, a commit every ``--batches-per-commit`` batches, and the function returns
the figures it measured.
"""

import argparse
import timeit

import compat_events
import horovod.tensorflow as hvd
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-warmup-batches", type=int, default=4)
parser.add_argument("--num-batches-per-iter", type=int, default=4)
parser.add_argument("--num-iters", type=int, default=12)
parser.add_argument("--batches-per-commit", type=int, default=2)
args = parser.parse_args()

hvd.init()
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

lr = 0.01
model = tf.keras.Sequential(
    [
        tf.keras.layers.Conv2D(8, 3, activation="relu", input_shape=(16, 16, 3)),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(10, activation="softmax"),
    ]
)
opt = tf.optimizers.SGD(lr * hvd.size())
data = tf.random.stateless_uniform([args.batch_size, 16, 16, 3], seed=(1, 2))
target = tf.random.stateless_uniform(
    [args.batch_size, 1], seed=(3, 4), minval=0, maxval=10, dtype=tf.int64
)


@tf.function
def train_one_batch():
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(target, probs)
    tape = hvd.DistributedGradientTape(tape)
    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables, strict=True))


def benchmark_step(state):
    train_one_batch()
    state.batch += 1
    if state.batch == args.batches_per_commit:
        state.batch = 0
        state.commit()
        compat_events.hold_here(state, hvd, state.iter + 1)


# Run one batch to initialize weights before synchronization.
train_one_batch()


@hvd.elastic.run
def run_benchmark(state):
    if not state.warm:
        timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
        state.warm = True
        state.commit()
    for x in range(state.iter, args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
        state.img_secs.append(args.batch_size * args.num_batches_per_iter / time)
        state.iter = x + 1
        state.commit()
    return len(state.img_secs), hvd.size()


def on_state_reset():
    opt.learning_rate.assign(lr * hvd.size())


state = hvd.elastic.TensorFlowKerasState(model, opt, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
measured, size = run_benchmark(state)
compat_events.emit(
    "done",
    size=hvd.size(),
    returned=[measured, size],
    iters=state.iter,
    digest=compat_events.digest(model.get_weights()),
)
