"""ea.run never takes a failed step for the end of training (elastic_allreduce.training.loop).

Horovod's hvd.elastic.run drops a TensorFlow UnknownError that does not name one of its op
types and returns None; a collective with a name of the script's fails with such a message, so
training ended early and silently. Real Horovod, one process.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from elastic_allreduce.training.loop import is_collective_failure
from tests.conftest import ROOT, script_result

SCRIPT = ROOT / "tests" / "scripts" / "run_errors.py"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Horovod has been shut down. This was caused by an exception on one of the ranks", True),
        (
            "{{node zoo_train_loss}} [gloo/transport/tcp/pair.cc:598] Connection closed",
            True,
        ),
        ("NCCL error: unhandled system error (ncclSystemError)", True),
        ("{{function_node __wrapped__HorovodAllreduce_grads_0}} ...", True),
        ("reading a shard failed: Input/output error", False),
    ],
)
def test_collective_failures_are_told_from_other_errors(message: str, expected: bool) -> None:
    assert is_collective_failure(tf.errors.UnknownError(None, None, message)) is expected
    assert is_collective_failure(tf.errors.AbortedError(None, None, message)) is expected


def test_other_errors_are_never_collective_failures() -> None:
    assert not is_collective_failure(ValueError("horovod"))
    assert not is_collective_failure(tf.errors.InvalidArgumentError(None, None, "horovod"))


def test_ea_run_raises_what_horovods_run_drops_and_retries_a_failed_collective() -> None:
    result = script_result(SCRIPT)
    # Horovod's own wrapper: the training function "returns" None.
    assert result["horovod"] == "None", result
    assert result["elastic_allreduce"] == "raised", result
    # A collective's failure rolls back to the commit (step 0) and runs the function again.
    assert result["retried"] == "trained", result
    assert result["attempts"] == [0, 0], result
