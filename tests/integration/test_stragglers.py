"""A rank that holds the ring back is reported and evicted (issue #15, item 2): two ranks train
evenly (no straggler, however slow each step), then one rank is held to 5 % of a CPU by a CPU
quota (a cgroup, as a noisy neighbour or a throttled machine would): the launcher names it (a
log line and a Straggler event) and, with --straggler-policy evict, replaces its node. (A
SIGSTOP duty cycle would slow it too, but the agent takes a process it sees stopped twice in a
row for a hang and replaces it.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cgroups import cpu_quota
from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.integration.harness import UNTIL_SCRIPT, Job, start_job, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_an_even_ring_has_no_straggler_and_a_slowed_rank_is_reported_and_evicted(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    stop_file, events_file = tmp_path / "stop", tmp_path / "events.jsonl"
    job = start_job(
        etcd_server,
        *("--workers", "2", "--start-grace", "120", "--straggler-policy", "evict"),
        *("--events-file", str(events_file)),
        script=UNTIL_SCRIPT,
        script_args=until(stop_file, commit_every=50, step_delay=0.05),
    )
    jobs.append(job)
    # Evenly slow (50 ms of each step is every rank's own): the watch's window of 10 reports
    # fills twice over, and nothing is reported.
    job.wait_for(lambda: len(job.commits(2)) >= 2, 120, "both ranks training")
    seen = len(job.commits(2))
    job.wait_for(lambda: len(job.commits(2)) >= seen + 8, 120, "20 s of even training")
    assert not any("straggler" in line for line in job.lines), job.tail()

    victim = next(e.slot for e in job.commits(2) if e.data["rank"] == 1)
    node = victim.split(".")[0]
    # Rank 1 may be on either first node: the replacement is a node neither of them is.
    first_nodes = {e.slot.split(".")[0] for e in job.commits(2)}
    with cpu_quota(job.pid(keys.proc(victim)), 5):
        job.wait_for(lambda: any("evicting node" in line for line in job.lines), 120, "eviction")
    (line,) = [line for line in job.lines if "is a straggler" in line]
    assert f"slot {victim} is a straggler" in line, line
    assert any(f"evicting node {node} (a straggler" in line for line in job.lines), job.tail()
    # Its node leaves gracefully (no rollback, no restart spent) and a new node takes its place.
    job.wait_for(
        lambda: any(e.slot.split(".")[0] not in first_nodes for e in job.commits(2)),
        120,
        "the replacement training at size 2",
    )
    stop_file.touch()
    assert job.finish() == 0, job.tail()
    assert not any("rolled back" in line or "crashed" in line for line in job.lines), job.tail()
    done = job.done()
    assert len(done) == 2 and node not in {e.slot.split(".")[0] for e in done}, (
        [e.data for e in done],
        job.tail(80),
    )
    assert len({e.data["checksum"] for e in done}) == 1, [e.data for e in done]
    events = [json.loads(raw) for raw in events_file.read_text().splitlines()]
    reported = [e for e in events if e["kind"] == "Straggler"]
    assert [e["slots"] for e in reported] == [[victim]], reported
