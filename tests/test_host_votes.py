"""Batched host-update votes (issue #15, item 3), with real Horovod at size 1 in a process of its
own: a notification interrupts at the commit the last vote agreed on -- about every 0.5 s of
commits, at most 100 commits later -- not at the next commit; at every commit with an interval
of 0; at once when the script checks by itself. The agreement between ranks is stepped in
tests/test_plain.py; end to end every join and leave of the integration tests goes through it."""

from __future__ import annotations

import os

import pytest

from elastic_allreduce import env
from elastic_allreduce.agreement import plain
from tests.conftest import ROOT, script_result

pytestmark = pytest.mark.timeout(180)

SCRIPT = ROOT / "tests" / "scripts" / "host_votes.py"


def run(interval: str | None) -> dict[str, object]:
    environment = {k: v for k, v in os.environ.items() if k != env.HOST_CHECK_INTERVAL}
    if interval is not None:
        environment[env.HOST_CHECK_INTERVAL] = interval
    return script_result(SCRIPT, environment)


def test_commits_vote_in_batches_and_an_interval_of_zero_votes_at_each_one() -> None:
    batched = run(None)
    # Commits of a few ms each: the vote after the first asks for the most commits allowed.
    assert batched["ea_state"] == plain.MOST_COMMITS_PER_VOTE, batched
    assert batched["horovod_state"] == plain.MOST_COMMITS_PER_VOTE, batched
    assert batched["ea_state_explicit"] is True, batched
    # A refused attribute (a tuple) waits for the vote, which raises it (after it was fixed:
    # the refusal of the commit that held it is kept until then).
    assert batched["refusal"] == plain.MOST_COMMITS_PER_VOTE - 1, batched
    every = run("0")
    assert every["ea_state"] == 1 and every["horovod_state"] == 1, every
    assert every["refusal"] == 0, every
