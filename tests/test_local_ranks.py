"""Local ranks keep Horovod's meaning under elastic-run (issue #39, item 5): a script reads its
slot's index on its node and the node's number of slots, whatever Horovod's C++ side keeps
(every slot is a Horovod host of its own: 0 of 1). Across restarts and with slots away:
tests/compat/test_compat.py (pattern f)."""

from __future__ import annotations

import pytest

from elastic_allreduce import env, runtime
from elastic_allreduce.errors import ConfigError
from tests.conftest import ROOT, script_result

SCRIPT = ROOT / "tests" / "scripts" / "local_ranks.py"


@pytest.mark.timeout(120)
def test_every_binding_of_horovod_returns_the_slots_local_rank_and_size() -> None:
    result = script_result(SCRIPT)
    assert result == {
        "before_init": "ValueError",  # as Horovod's, before hvd.init()
        "hvd": [2, 4],
        "hvd_keras": [2, 4],
        "mpi_ops": [2, 4],
        "horovod_keras": [2, 4],
        "ea": [2, 4],
        "horovod_internal": [0, 1],
        "rank_size": [0, 1],
    }, result


def test_the_local_rank_is_the_slots_index_and_the_size_the_nodes_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env.SLOT, "gpu-node-7.3")
    monkeypatch.setenv(env.LOCAL_SIZE, "8")
    assert (runtime.local_rank(), runtime.local_size()) == (3, 8)


def test_outside_elastic_run_there_is_no_slot_view(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.SLOT, raising=False)
    monkeypatch.setenv(env.LOCAL_SIZE, "8")
    assert (runtime.local_rank(), runtime.local_size()) == (None, None)


@pytest.mark.parametrize("value", ["", "0", "3", "four"])
def test_a_local_size_that_cannot_hold_the_slot_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(env.SLOT, "n0.3")
    monkeypatch.setenv(env.LOCAL_SIZE, value)
    with pytest.raises(ConfigError, match=r"ELASTIC_ALLREDUCE_LOCAL_SIZE=.*slot n0\.3 has index 3"):
        runtime.local_size()
