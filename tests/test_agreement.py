"""The state agreement before a sync: wire form, verdict and messages (pure), and the Keras
optimizer helpers that create a newcomer's optimizer variables (real TensorFlow, no Horovod)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_allreduce.agreement import shape as agreement
from elastic_allreduce.agreement.shape import StateDescription, VariableSpec
from elastic_allreduce.errors import ProtocolError

KERNEL = VariableSpec("dense/kernel:0", (4, 1), "float32")
BIAS = VariableSpec("dense/bias:0", (1,), "float32")
ITERATION = VariableSpec("iteration:0", (), "int64")
SLOTS = (
    VariableSpec("Adam/m/dense/kernel:0", (4, 1), "float32"),
    VariableSpec("Adam/v/dense/kernel:0", (4, 1), "float32"),
)
TRAINED = StateDescription(
    model=(KERNEL, BIAS),
    optimizer=(ITERATION, *SLOTS),
    optimizer_built=True,
    extra_keys=("commit_id", "step"),
    commit_id=4,
    slot="n0.0",
)
#: A restarted process that has not trained a step: its optimizer has only the iteration count.
FRESH = dataclasses.replace(
    TRAINED, optimizer=(ITERATION,), optimizer_built=False, commit_id=0, slot="n1.0"
)


def gathered(*descriptions: StateDescription) -> bytes:
    return b"".join(d.encode() for d in descriptions)


def test_descriptions_round_trip_in_rank_order_as_json_lines() -> None:
    raw = gathered(TRAINED, FRESH, TRAINED)
    assert raw.count(agreement.SEPARATOR) == 3
    assert json.loads(raw.split(agreement.SEPARATOR)[0])["version"] == agreement.VERSION
    assert agreement.decode_all(raw, 3) == [TRAINED, FRESH, TRAINED]


def test_a_name_with_a_newline_stays_on_its_line() -> None:
    odd = dataclasses.replace(TRAINED, model=(VariableSpec("a\nb", (None, 2), "float32"),))
    assert agreement.decode_all(gathered(odd, TRAINED), 2) == [odd, TRAINED]


@pytest.mark.parametrize(
    ("raw", "size", "message"),
    [
        (gathered(TRAINED), 2, "expected 2 lines from 2 ranks, got 1"),
        (gathered(TRAINED) + b"{}", 2, "expected 2 lines"),
        (b"\xff\n", 1, "rank 0's state description is not UTF-8 JSON"),
        (b"[1]\n", 1, "is not a JSON object"),
        (b'{"version": 2}\n', 1, "has version 2, this rank reads 1"),
        (
            gathered(TRAINED).replace(b'"optimizer_built":true', b'"optimizer_built":1'),
            1,
            "optimizer_built must be true or false",
        ),
        (
            gathered(TRAINED).replace(b'"commit_id":4', b'"commit_id":"4"'),
            1,
            "commit_id must be an integer",
        ),
        (
            gathered(TRAINED).replace(b"[4,1]", b'["4",1]', 1),
            1,
            "model: .* is not \\[name, shape, dtype\\]",
        ),
        (
            gathered(TRAINED).replace(b'"extra_keys":["commit_id","step"]', b'"extra_keys":3'),
            1,
            "extra_keys must be a list of strings",
        ),
    ],
)
def test_a_malformed_description_is_a_protocol_error(raw: bytes, size: int, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        agreement.decode_all(raw, size)


def test_the_root_is_the_lowest_rank_with_the_newest_commit() -> None:
    older = dataclasses.replace(TRAINED, commit_id=3)
    assert agreement.newest_commit_root([older, TRAINED, FRESH, TRAINED]) == 1
    assert agreement.newest_commit_root([FRESH, dataclasses.replace(FRESH, commit_id=None)]) == 0


def test_unbuilt_optimizers_are_built_only_when_another_rank_has_trained() -> None:
    assert agreement.ranks_to_build([TRAINED, FRESH, TRAINED, FRESH]) == [1, 3]
    assert agreement.ranks_to_build([FRESH, FRESH]) == []
    assert agreement.ranks_to_build([TRAINED, TRAINED]) == []


def test_equal_states_agree() -> None:
    assert agreement.first_mismatch([TRAINED, TRAINED, TRAINED], 0) is None
    assert agreement.first_mismatch([FRESH, FRESH], 1) is None


def test_a_mismatch_names_the_first_rank_that_differs_and_the_variable_on_both_sides() -> None:
    wider = dataclasses.replace(
        TRAINED, model=(KERNEL, VariableSpec("dense/bias:0", (4,), "float32")), slot="n2.0"
    )
    message = agreement.first_mismatch([TRAINED, TRAINED, wider, FRESH], 0)
    assert message is not None
    assert "rank 2 (slot n2.0) does not match rank 0 (slot n0.0)" in message
    assert (
        "model variable #1 is 'dense/bias:0' float32 (1,) on rank 0 but "
        "'dense/bias:0' float32 (4,) on rank 2 (2 vs 2 model variables)" in message
    )
    assert "the same layers in the same order" in message


def test_a_missing_variable_and_other_extra_keys_are_mismatches() -> None:
    message = agreement.first_mismatch([TRAINED, FRESH], 0)
    assert message is not None
    assert (
        "optimizer variable #1 is 'Adam/m/dense/kernel:0' float32 (4, 1) on rank 0 but "
        "absent on rank 1 (3 vs 1 optimizer variables)" in message
    )
    other_keys = dataclasses.replace(TRAINED, extra_keys=("commit_id", "epoch"), slot=None)
    message = agreement.first_mismatch([other_keys, TRAINED], 1)
    assert message is not None
    assert "rank 0 does not match rank 1 (slot n0.0)" in message
    assert "['commit_id', 'step'] on rank 1 but ['commit_id', 'epoch'] on rank 0" in message


# -- the Keras optimizer helpers (TensorFlow, no Horovod collectives) ---------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["keras-optimizer", "legacy-optimizer"])
def test_a_built_optimizer_has_the_variables_its_first_step_would_create(legacy: bool) -> None:
    import tensorflow as tf  # noqa: PLC0415 - only this test needs TensorFlow

    from elastic_allreduce import keras_compat  # noqa: PLC0415
    from elastic_allreduce.agreement import sync  # noqa: PLC0415

    def make() -> tuple[object, object]:
        # Named as a script's objects are named alike on every rank (one per process there;
        # Keras 3 would call the second model and optimizer of one process "..._1").
        keras = tf.keras
        if legacy and keras_compat.is_keras3(tf.keras.optimizers.SGD()):
            import tf_keras as keras  # noqa: PLC0415 - the legacy optimizers live there now
        model = keras.Sequential([keras.layers.Dense(2, name="d")], name="m")
        model.build((None, 3))
        optimizers = keras.optimizers.legacy if legacy else keras.optimizers
        return model, optimizers.Adam(0.01, name="adam")

    trained_model, trained = make()

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(trained_model(tf.ones((2, 3))))
        grads = tape.gradient(loss, trained_model.trainable_variables)
        trained.apply_gradients(zip(grads, trained_model.trainable_variables, strict=True))

    step()
    fresh_model, fresh = make()
    assert sync.optimizer_built(trained) and not sync.optimizer_built(fresh)
    sync.build_optimizer(fresh, fresh_model)
    assert sync.optimizer_built(fresh)
    # Same names (Horovod names each variable's broadcast after it), shapes and dtypes ...
    assert (
        sync.describe(fresh_model, fresh, {}).optimizer
        == sync.describe(trained_model, trained, {}).optimizer
    )
    # ... and the names of the TensorFlow variables themselves, after which Horovod names the
    # broadcasts (a name in another scope would be a broadcast no trained rank joins) ...
    assert [keras_compat.tf_variable(v).name for v in keras_compat.optimizer_variables(fresh)] == [
        keras_compat.tf_variable(v).name for v in keras_compat.optimizer_variables(trained)
    ]
    # ... and nothing applied: the iteration count and the slots are still zero (Keras 3 keeps
    # its learning rate in a variable too).
    assert all(
        not tf.reduce_any(tf.cast(v, tf.bool))
        for v in keras_compat.optimizer_variables(fresh)
        if "learning_rate" not in v.name
    )
