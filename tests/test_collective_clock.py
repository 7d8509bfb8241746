"""The collective clock (issue #15, item 2: each rank measures its own compute share): the
gradient allreduces of ea's tape and optimizer are timed, and under elastic-run (the bootstrap's
hooks) so are Horovod's own -- custom loops and Keras ``fit`` alike. Real Horovod at size 1 in a
process of its own; the straggler watch that reads the clock: tests/test_stragglers.py and
tests/integration/test_stragglers.py."""

from __future__ import annotations

import pytest

from tests.conftest import KERAS3, ROOT, script_result

pytestmark = pytest.mark.timeout(180)

SCRIPT = ROOT / "tests" / "scripts" / "timed_allreduce.py"


def test_every_gradient_allreduce_of_a_training_step_is_timed_once() -> None:
    result = script_result(SCRIPT)
    assert result == {
        # Outside elastic-run Horovod's own tape is Horovod's, untouched.
        "horovod_tape_before_hooks": False,
        "ea_tape": True,
        "ea_optimizer_fit": True,
        "horovod_tape": True,
        # Under Keras 3 the hooks refuse Horovod's Keras optimizer (it would never reduce).
        "horovod_keras_optimizer_fit": "refused" if KERAS3 else True,
        "timed_once": True,
    }, result


TRACED = ROOT / "tests" / "scripts" / "traced_steps.py"


def test_the_clock_survives_the_ways_users_trace_their_step() -> None:
    """Issue #39: the clock's variable used to be made inside the user's trace, so Horovod's
    documented warm-up (first trace without the tape wrapped) failed at the second trace.
    Fails with the variable made in the trace again (checked)."""
    result = script_result(TRACED)
    assert result.pop("traces") >= 3, result  # the warm-up, the wrapped step, the new shape
    assert result == {
        "traced_before_init": True,
        "warm_up_first": True,
        "retraced": True,
        "second_function": True,
    }, result
