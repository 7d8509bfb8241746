"""Junk in a live job's prefix -- stray keys, values of the wrong shape, bytes that are not JSON --
is reported and skipped by every reader; the job trains on and finishes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import write_raw
from tests.integration.harness import UNTIL_SCRIPT, Job, run_cli, slot_of_rank, start_job, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: Values a foreign or buggy writer could leave, each under a key readers list.
JUNK = {
    "procs/x": {"pid": 1},
    "exits/n0.0/abc": {"code": 1},
    "members/a.b": {"host": "h", "slots": 1},
    "members/n7": {"host": "h", "slots": "many"},
    keys.SCALE_TARGET: {"workers": "all of them"},
    "status/other": {"phase": "running"},
    "stray": 1,
}


def test_junk_keys_in_a_live_job_are_skipped_and_the_job_finishes(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """The job trains until the restarted rank is back in the ring (its import may take long
    on a loaded machine): a job of fixed length could end on two ranks before."""
    stop_file = tmp_path / "stop"
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "1"),
        script=UNTIL_SCRIPT,
        script_args=until(stop_file),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 3, 120, "commits at size 3")
    for key, value in JUNK.items():
        job.store.put(key, value)
    write_raw(job.store, "exits/n1.0/9", b"\x00not json")
    # Well-formed records from a writer that is not the leader (issue #14, item 4): a status
    # that says the job ended (unstamped) and a directive that stops a node's slot (stamped
    # with a lease that is not the leader's). The agents ignore both.
    job.store.put(keys.JOB_STATUS, {"phase": "succeeded", "reason": "forged"})
    leader = job.store.get(keys.LEADER)
    assert leader is not None and leader.lease is not None
    job.store.put(keys.directive("n0"), {"slots": {}, "leader": leader.lease + 1})
    # A crash after the junk landed: the launcher and the agents must act through it.
    victim = slot_of_rank(job, 2, 3)
    epochs_before = {e.epoch for e in job.commits()}
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    status = run_cli("status", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id)
    job.wait_for(
        lambda: any(e.slot == victim and e.epoch not in epochs_before for e in job.commits(3)),
        120,
        "the restarted rank back in the ring",
    )
    stop_file.touch()
    assert job.finish() == 0, job.tail()
    done = job.done()
    assert len(done) == 3 and len({e.data["step"] for e in done}) == 1, job.tail(400)
    assert len({e.data["checksum"] for e in done}) == 1
    crashed = f"slot {victim} crashed: killed by SIGKILL"
    assert any(crashed in line and "restarting it" in line for line in job.lines), job.tail()
    launcher_warnings = [line for line in job.lines if "launcher] ignoring key" in line]
    for key in [*JUNK, "exits/n1.0/9"]:
        assert any(repr(key) in line for line in launcher_warnings), (key, launcher_warnings)
    assert len(launcher_warnings) == len(JUNK) + 1, launcher_warnings  # each one once
    assert any("node n0] ignoring key 'procs/x'" in line for line in job.lines), job.tail()
    for node in ("n0", "n1", "n2"):
        assert any(
            f"node {node}] ignoring status/job: not written by the job's leader" in line
            for line in job.lines
        ), job.tail()
    assert any(
        "node n0] ignoring directives/n0: not written by the job's leader" in line
        for line in job.lines
    ), job.tail()
    assert not any("n0.0] stopping incarnation" in line for line in job.lines), job.tail()
    assert status.returncode == 0, status.stderr
    assert "skipped key members/n7: the member record: field 'slots'" in status.stdout


def test_a_forged_config_job_changes_nothing_that_the_workers_run(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """``config/job`` rewritten by a writer that is not the leader (issue #14, item 4), with a
    command that would leave a marker file: the node the launcher starts afterwards (a
    scale-up) and a process restarted after a crash run the launcher's own command."""
    stop_file = tmp_path / "stop"
    marker = tmp_path / "the-forged-command-ran"
    job = start_job(
        etcd_server,
        *("--workers", "1", "--max-workers", "2", "--max-restarts", "1"),
        script=UNTIL_SCRIPT,
        script_args=until(stop_file),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(1)) >= 3, 120, "commits at size 1")
    stored = job.store.get(keys.JOB_CONFIG)
    assert stored is not None and isinstance(stored.value, dict), stored
    assert "command" in stored.value, stored.value
    forged = {**stored.value, "command": ["python", "-c", f"open({str(marker)!r}, 'w')"]}
    job.store.put(keys.JOB_CONFIG, forged)

    scaled = run_cli("scale", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id, "2")
    assert scaled.returncode == 0, scaled.stderr
    job.wait_for(lambda: any(e.slot == "n1.0" for e in job.commits(2)), 120, "the new node")
    victim = slot_of_rank(job, 1, 2)
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    killed_at = time.monotonic()
    job.wait_for(
        lambda: {e.slot for e in job.commits(2) if e.at > killed_at} == {"n0.0", "n1.0"},
        120,
        "both ranks training after the restart",
    )
    stop_file.touch()
    assert job.finish() == 0, job.tail()
    assert not marker.exists(), job.tail()
    assert {e.slot for e in job.done()} == {"n0.0", "n1.0"}, job.tail()
    assert any(f"slot {victim} crashed" in line for line in job.lines), job.tail()
