"""Model definition: a CNN on the 8x8 handwritten digits of scikit-learn.

The same network as examples/cnn_digits.py, as a model definition for ``elastic-run train``
(the loop is the built-in one). Data: ``python examples/model_zoo/make_data.py digits --out
DIR`` (features ``image``: 64 floats 0-16, ``label``: 0-9).

    elastic-run train --model-def examples/model_zoo/digits_cnn.py \\
        --training-data 'DIR/train-*.tfrecord' --validation-data 'DIR/valid-*.tfrecord' \\
        --epochs 12 --global-batch 64 --workers 2 --output out/digits
"""

import tensorflow as tf

FEATURES = {
    "image": tf.io.FixedLenFeature([64], tf.float32),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def custom_model() -> tf.keras.Model:
    return tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1), name="image"),
            tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf.keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


def loss(labels, predictions):
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)
    )


def optimizer():
    return tf.keras.optimizers.Adam(0.003)


def dataset_fn(dataset, mode):
    def parse(record):
        example = tf.io.parse_single_example(record, FEATURES)
        image = tf.reshape(example["image"], [8, 8, 1]) / 16.0
        return image, example["label"]

    return dataset.map(parse)


def eval_metrics_fn():
    return {"accuracy": tf.keras.metrics.SparseCategoricalAccuracy()}
