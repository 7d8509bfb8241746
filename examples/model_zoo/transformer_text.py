"""Model definition: a Transformer encoder that tells which standard-library package a window
of Python source comes from (asyncio, email, xml, tkinter, ...; eight classes).

Bytes in, a learned position embedding, two pre-norm encoder blocks (multi-head self-attention
and a feed-forward layer, each with a residual), mean pooling, a softmax over the packages.
Data: ``python examples/model_zoo/make_data.py packages --out DIR`` (features ``text``: 128
bytes, ``label``: the package). The learning rate warms up over the first 100 steps
(``learning_rate_schedule``).

    elastic-run train --model-def examples/model_zoo/transformer_text.py \\
        --training-data 'DIR/train-*.tfrecord' --validation-data 'DIR/valid-*.tfrecord' \\
        --epochs 6 --global-batch 64 --workers 2 --output out/packages
"""

import tensorflow as tf

LENGTH = 128
CLASSES = 8
WIDTH = 64
HEADS = 4
BLOCKS = 2
DROPOUT = 0.1
PEAK_RATE = 0.001
WARMUP_STEPS = 100


@tf.keras.utils.register_keras_serializable("model_zoo")
class PositionEmbedding(tf.keras.layers.Layer):
    """Adds a learned embedding of each position to a (batch, length, width) input."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.positions = self.add_weight(
            name="positions", shape=(self.length, input_shape[-1]), initializer="random_normal"
        )

    def call(self, inputs):
        return inputs + self.positions[: tf.shape(inputs)[1]]

    def get_config(self):
        return {**super().get_config(), "length": self.length}


def _block(x):
    attended = tf.keras.layers.LayerNormalization()(x)
    attended = tf.keras.layers.MultiHeadAttention(HEADS, WIDTH // HEADS, dropout=DROPOUT)(
        attended, attended
    )
    x = x + attended
    fed = tf.keras.layers.LayerNormalization()(x)
    fed = tf.keras.layers.Dense(4 * WIDTH, activation="gelu")(fed)
    fed = tf.keras.layers.Dropout(DROPOUT)(tf.keras.layers.Dense(WIDTH)(fed))
    return x + fed


def custom_model() -> tf.keras.Model:
    codes = tf.keras.Input((LENGTH,), dtype=tf.int32, name="bytes")
    x = tf.keras.layers.Embedding(256, WIDTH)(codes)
    x = PositionEmbedding(LENGTH)(x)
    for _ in range(BLOCKS):
        x = _block(x)
    x = tf.keras.layers.LayerNormalization()(x)
    x = tf.keras.layers.GlobalAveragePooling1D()(x)
    return tf.keras.Model(codes, tf.keras.layers.Dense(CLASSES)(x))


def loss(labels, predictions):
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer():
    return tf.keras.optimizers.Adam(PEAK_RATE)


def learning_rate_schedule(step):
    return PEAK_RATE * min(1.0, (step + 1) / WARMUP_STEPS)


def dataset_fn(dataset, mode):
    spec = {
        "text": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        codes = tf.cast(tf.io.decode_raw(example["text"], tf.uint8), tf.int32)
        return tf.ensure_shape(codes, [LENGTH]), example["label"]

    return dataset.map(parse)


def eval_metrics_fn():
    return {"accuracy": tf.keras.metrics.SparseCategoricalAccuracy()}
