"""The model-zoo pieces with TensorFlow, in this process: records through dataset_fn, and the
checks of what a definition's functions return (each failure names the function)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from elastic_allreduce import keras_compat
from elastic_allreduce.errors import ConfigError
from elastic_allreduce.zoo.contract import ModelDef, check_definition
from elastic_allreduce.zoo.pipeline import (
    RecordParser,
    build,
    make_pieces,
    parse_checked,
)

SPEC = {"x": tf.io.FixedLenFeature([3], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}


def records(count: int) -> tf.Tensor:
    rows = []
    for i in range(count):
        feature = {
            "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i, i, i])),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2])),
        }
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        rows.append(example.SerializeToString())
    return tf.constant(rows, tf.string, shape=[count])


def pairs(dataset: tf.data.Dataset, mode: str) -> tf.data.Dataset:
    def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        example = tf.io.parse_single_example(record, SPEC)
        return example["x"], example["y"]

    return dataset.map(parse)


def definition(**changes: Callable[..., Any]) -> ModelDef:
    pieces: dict[str, object] = {
        "custom_model": lambda: tf.keras.Sequential([tf.keras.layers.Dense(2)]),
        "loss": lambda labels, predictions: tf.reduce_mean(
            tf.keras.losses.sparse_categorical_crossentropy(labels, predictions, True)
        ),
        "optimizer": lambda: tf.keras.optimizers.SGD(0.1),
        "dataset_fn": pairs,
        **changes,
    }
    return check_definition("test_def.py", pieces)


def test_records_become_batches_of_pairs_and_an_empty_batch_keeps_its_shape() -> None:
    parser = RecordParser(definition(), "train")
    features, labels = parse_checked(parser, records(5))
    assert features.shape == (5, 3) and labels.numpy().tolist() == [0, 1, 0, 1, 0]
    assert features.numpy()[4].tolist() == [4.0, 4.0, 4.0]
    empty_features, empty_labels = parse_checked(parser, records(0))
    assert empty_features.shape == (0, 3) and empty_labels.shape == (0,)
    assert [s.shape.as_list() for s in parser.element_spec] == [[None, 3], [None]]


def test_a_dataset_fn_that_gives_features_only_is_refused_except_for_predict() -> None:
    def features_only(dataset: tf.data.Dataset, mode: str) -> tf.data.Dataset:
        return pairs(dataset, mode).map(lambda x, y: x)

    bad = definition(dataset_fn=features_only)
    with pytest.raises(ConfigError) as caught:
        RecordParser(bad, "train")
    assert "test_def.py: dataset_fn(dataset, mode) must give (features, labels) pairs" in str(
        caught.value
    )
    assert "it gives elements float32[3]" in str(caught.value)
    parser = RecordParser(bad, "predict")
    assert not parser.pairs
    assert parse_checked(parser, records(2)).shape == (2, 3)


def test_a_dataset_fn_that_drops_or_batches_records_is_refused_on_real_records() -> None:
    def drops(dataset: tf.data.Dataset, mode: str) -> tf.data.Dataset:
        return pairs(dataset, mode).filter(lambda x, y: y > 0)

    with pytest.raises(ConfigError, match="exactly one element per record"):
        parse_checked(RecordParser(definition(dataset_fn=drops), "train"), records(4))
    with pytest.raises(ConfigError, match=r"returned a list, not a tf\.data\.Dataset"):
        RecordParser(definition(dataset_fn=lambda dataset, mode: []), "evaluate")
    with pytest.raises(ConfigError, match="unknown dataset_fn mode 'test'"):
        RecordParser(definition(), "test")


def legacy_optimizers() -> Any:
    """Keras 2's legacy optimizers: tf.keras's with Keras 2, tf-keras's beside Keras 3."""
    if keras_compat.is_keras3(tf.keras.optimizers.SGD()):
        import tf_keras  # noqa: PLC0415 - only where Keras 3 is tf.keras

        return tf_keras.optimizers.legacy
    return tf.keras.optimizers.legacy


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"custom_model": lambda: "a model"}, "custom_model() returned a str, not a tf.keras"),
        (
            {"optimizer": lambda: legacy_optimizers().SGD(0.1)},
            "a legacy optimizer: use tf.keras.optimizers.X",
        ),
        ({"eval_metrics_fn": lambda: ["accuracy"]}, "returned a list, not a dict"),
        (
            {"eval_metrics_fn": lambda: {"loss": tf.keras.metrics.Mean()}},
            "returned the key 'loss'",
        ),
        ({"callbacks": lambda: [print]}, "not a list of tf.keras.callbacks.Callback"),
        ({"custom_model": lambda: 1 / 0}, "custom_model() raised ZeroDivisionError"),
    ],
)
def test_what_the_constructors_return_is_checked(
    changes: dict[str, Callable[..., Any]], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        make_pieces(definition(**changes))
    assert str(caught.value).startswith("model definition test_def.py: ")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {
                "loss": lambda labels, predictions: tf.keras.losses.sparse_categorical_crossentropy(
                    labels, predictions, True
                )
            },
            "loss(labels, predictions) must return a scalar float tensor (the mean over the "
            "batch); it returned float32 of shape [4]",
        ),
        (
            {"custom_model": lambda: tf.keras.Sequential([tf.keras.layers.Reshape((9,))])},
            "custom_model() returned a model that cannot take the features",
        ),
        (
            {
                "optimizer": lambda: tf.keras.optimizers.SGD(
                    tf.keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
                ),
                "learning_rate_schedule": lambda step: 0.1,
            },
            "learning_rate_schedule(step) is given, but optimizer() already has a "
            "LearningRateSchedule",
        ),
        (
            {"eval_metrics_fn": lambda: {"acc": tf.keras.metrics.Accuracy()}},
            # ValueError (Keras 2) or InvalidArgumentError (Keras 3): the shapes, either way.
            "gave the metric 'acc', which cannot take (labels, predictions): ",
        ),
    ],
)
def test_the_model_loss_and_metrics_run_once_on_real_records(
    changes: dict[str, Callable[..., Any]], message: str
) -> None:
    model_def = definition(**changes)
    pieces = make_pieces(model_def)
    with pytest.raises(ConfigError) as caught:
        build(pieces, model_def, RecordParser(model_def, "train"), records(4))
    assert message in str(caught.value)


def test_a_good_definition_builds_its_model_and_optimizer() -> None:
    model_def = definition(
        eval_metrics_fn=lambda: {"acc": tf.keras.metrics.SparseCategoricalAccuracy()}
    )
    pieces = make_pieces(model_def)
    report = build(pieces, model_def, RecordParser(model_def, "train"), records(4))
    assert report.parameters == 3 * 2 + 2
    assert (report.features, report.labels, report.predictions) == (
        "float32[?,3]",
        "int64[?]",
        "float32[?,2]",
    )
    # Built: a rank that syncs it has its variables.
    assert keras_compat.optimizer_variables(pieces.optimizer)
    assert float(pieces.metrics["acc"].count.numpy()) == 0.0  # reset after the check
    assert np.isfinite(report.loss)
