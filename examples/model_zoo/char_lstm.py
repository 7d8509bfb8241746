"""Model definition: a byte-level LSTM language model on the standard library's own source.

examples/nlp_text.py's model as a model definition for ``elastic-run train``, reading bytes
(a vocabulary of 256) instead of characters. Data: ``python examples/model_zoo/make_data.py
chars --out DIR`` (feature ``window``: 65 bytes; the model reads the first 64 and predicts the
next byte at every position). The loss is in nats per byte: the reported ``perplexity`` metric
is exp(loss), to compare with the unigram perplexity in DIR/info.json.

    elastic-run train --model-def examples/model_zoo/char_lstm.py \\
        --training-data 'DIR/train-*.tfrecord' --validation-data 'DIR/valid-*.tfrecord' \\
        --epochs 1 --global-batch 64 --workers 2 --output out/chars
"""

import tensorflow as tf

VOCAB = 256
UNITS = 192


@tf.keras.utils.register_keras_serializable("model_zoo")
class Perplexity(tf.keras.metrics.Mean):
    """exp of the mean cross-entropy per byte (a mean of the per-window losses, then exp)."""

    def update_state(self, labels, predictions, sample_weight=None):
        losses = tf.keras.losses.sparse_categorical_crossentropy(
            labels, predictions, from_logits=True
        )
        return super().update_state(losses, sample_weight)

    def result(self):
        return tf.exp(super().result())


def custom_model() -> tf.keras.Model:
    return tf.keras.Sequential(
        [
            tf.keras.Input((None,), dtype=tf.int32, name="bytes"),
            tf.keras.layers.Embedding(VOCAB, 48),
            tf.keras.layers.LSTM(UNITS, return_sequences=True),
            tf.keras.layers.Dense(VOCAB),
        ]
    )


def loss(labels, predictions):
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer():
    return tf.keras.optimizers.Adam(0.005, clipnorm=1.0)


def dataset_fn(dataset, mode):
    def parse(record):
        example = tf.io.parse_single_example(
            record, {"window": tf.io.FixedLenFeature([], tf.string)}
        )
        codes = tf.cast(tf.io.decode_raw(example["window"], tf.uint8), tf.int32)
        return codes[:-1], codes[1:]

    return dataset.map(parse)


def eval_metrics_fn():
    return {"perplexity": Perplexity()}
