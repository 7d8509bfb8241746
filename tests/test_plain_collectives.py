"""The plain-data collectives of a state between two real Horovod processes over Gloo
(`horovodrun -np 2`, tests/scripts/plain_collectives.py): what elastic_allreduce.State and, with
the hooks, Horovod's own TensorFlowKerasState send instead of pickles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = ROOT / "tests" / "scripts" / "plain_collectives.py"
HOROVODRUN = (
    str(Path(sys.executable).parent / "horovodrun"),
    "-np",
    "2",
    "-H",
    "localhost:2",
    "--gloo",
)


@pytest.fixture(scope="module")
def markers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the crafted pickle's payload would create its marker files."""
    return tmp_path_factory.mktemp("markers")


@pytest.fixture(scope="module")
def ranks(markers: Path) -> list[dict[str, Any]]:
    """Each rank's results, in rank order."""
    done = subprocess.run(
        [*HOROVODRUN, sys.executable, str(SCRIPT), str(markers)],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        cwd=SCRIPT.parent,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line
    ]
    assert sorted(r["rank"] for r in results) == [0, 1], output[-4000:]
    return sorted(results, key=lambda r: r["rank"])


def test_the_sync_sends_the_newest_commit_s_attributes_as_plain_values(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert result["no_bcast_object"] == "_no_pickles"
        # From rank 1, which held the newest commit; NumPy scalars arrived as Python values.
        assert result["synced"] == {
            "step": 7,
            "history": [0.5],
            "meta": {"rank": 1},
            "commit_id": 3,
        }
        assert result["types"] == ["int", "float"]


def test_a_notification_on_any_rank_interrupts_every_rank_at_the_same_commit(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert result["added_on_rank_1"] == "interrupt(False)"
        assert result["removed_on_rank_0"] == "interrupt(True)"
        assert result["stale"] == "ok"
        assert result["last_updated"] == 6
        assert result["horovod_added_on_rank_1"] == "interrupt(False)"
        assert result["horovod_commit_after"] == "ok"


def test_a_value_that_is_not_plain_fails_on_every_rank_without_a_hang(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert result["tuple_at_construction"].startswith(
            "StateValueError: State attribute 'when' is of type tuple (use a list), not plain data."
        ), result["tuple_at_construction"]
    mine, other = ranks[1]["tuple_on_rank_1_at_commit"], ranks[0]["tuple_on_rank_1_at_commit"]
    assert mine.startswith("StateValueError: State attribute 'history' is of type tuple"), mine
    assert other == (
        "StateValueError: cannot commit the training state: rank 1 holds a State attribute "
        "that is not plain data (its own error names it)"
    )
    assert ranks[0]["commit_after"] == ranks[1]["commit_after"] == "ok"
    assert ranks[0]["tuple_at_root_sync"].startswith("StateValueError: State attribute 'x' is")
    assert ranks[1]["tuple_at_root_sync"] == (
        "StateValueError: cannot sync the training state: rank 0, the rank it is synced from, "
        "holds a State attribute that is not plain data (its own error names it)"
    )


def test_a_pickled_payload_from_the_root_is_refused_on_every_rank_and_never_loaded(
    ranks: list[dict[str, Any]], markers: Path
) -> None:
    assert not list(markers.iterdir())
    for result in ranks:
        assert result["pickle_from_root"].startswith(
            "ProtocolError: the state attributes sent by rank 0 are not UTF-8 JSON"
        ), result["pickle_from_root"]
        assert result["marker_exists"] is False


def test_horovod_s_own_state_syncs_its_attributes_as_plain_values(
    ranks: list[dict[str, Any]],
) -> None:
    for result in ranks:
        assert result["horovod_sync"] == "ok"
        assert result["horovod_synced"] == {"batch": 0, "epoch": 2}
        # Rank 1's newer commit wins the next sync, and every rank then counts its commits.
        assert result["horovod_newest_sync"] == "ok"
        assert result["horovod_newest_synced"] == {"batch": 5, "epoch": 2}
        assert result["horovod_newest_commit_id"] == 99
    newest = ranks[1]["horovod_checksum_before"]
    assert ranks[0]["horovod_checksum_before"] != newest
    assert ranks[0]["horovod_newest_checksum"] == ranks[1]["horovod_newest_checksum"] == newest
