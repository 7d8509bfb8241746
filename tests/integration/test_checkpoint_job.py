"""Checkpoint folders of running jobs (issue #17, item 1). On a full filesystem each
checkpoint that cannot be written is skipped -- by rank 0, or by the agent that copies it from
the snapshot -- training goes on to the end, and the skips are reported, in the launcher's log
and as CheckpointSkipped events. Two jobs sharing one --checkpoint-dir neither load nor delete
each other's checkpoints, and a restarted process whose newest checkpoint was truncated resumes
from the previous one and says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_allreduce.commits.checkpoint import ARRAYS, CheckpointDir
from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.integration.harness import EA_SCRIPT, Job, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: A State commits every 5 steps and writes every 2nd commit: a checkpoint every 10 steps.
TRAIN = ("--steps", "120", "--commit-every", "5", "--checkpoint-every", "2")
TRAIN += ("--step-delay", "0.05")


@pytest.fixture
def full_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 4 KiB tmpfs (root is a requirement of this suite, DESIGN.md): no checkpoint fits."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mount_point)],
        check=True,
        capture_output=True,
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.parametrize("writer", ["rank-0", "agent"])
def test_checkpoints_on_a_full_filesystem_are_skipped_reported_and_training_finishes(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path, full_filesystem: Path, writer: str
) -> None:
    """Written by rank 0 in the commit (snapshots off) or by the agent from the snapshot."""
    events_file = tmp_path / "events.jsonl"
    snapshot_root = "off" if writer == "rank-0" else str(tmp_path / "shm")
    job = start_job(
        etcd_server,
        *("--workers", "1", "--checkpoint-dir", str(full_filesystem)),
        *("--events-file", str(events_file)),
        script=EA_SCRIPT,
        script_args=TRAIN,
        env={"ELASTIC_ALLREDUCE_SNAPSHOT_ROOT": snapshot_root},
    )
    jobs.append(job)
    assert job.finish() == 0, job.tail()
    (done,) = job.done()
    assert done.data["step"] == 120, done.data
    # Rank 0 warned at each skip; the launcher announced them.
    assert any("skipped the checkpoint of commit" in line for line in job.lines), job.tail()
    announced = [line for line in job.lines if "could not write" in line and "slot" in line]
    assert announced, job.tail()
    assert "no space left on the device" in announced[0], announced[0]
    assert ("the agent's copy" in announced[0]) == (writer == "agent"), announced[0]
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    skipped = [e for e in events if e["kind"] == "CheckpointSkipped"]
    assert skipped, [e["kind"] for e in events]
    assert all(e["slots"] == [done.slot] for e in skipped), skipped
    # Nothing was left on the full filesystem but the job's (empty) folder.
    leftovers = [p for p in full_filesystem.rglob("*") if p.is_file()]
    assert leftovers == [], leftovers
    assert os.path.ismount(full_filesystem)


#: Without snapshots a restarted process has only the checkpoints to resume from.
NO_SNAPSHOTS = {"ELASTIC_ALLREDUCE_SNAPSHOT_ROOT": "off"}


def test_jobs_sharing_a_checkpoint_dir_keep_to_their_own_and_a_truncated_one_is_passed_over(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Job B commits five times as fast as job A into the same --checkpoint-dir, with the same
    model. A's process is SIGKILLed and its newest checkpoint truncated before the restarted
    process loads: it falls back to A's previous checkpoint and says so -- not to B's newer
    ones. Each job keeps its own last two; neither removed the other's."""
    shared = tmp_path / "checkpoints"
    flags = ("--workers", "1", "--max-restarts", "1", "--checkpoint-dir", str(shared))
    train = ("--commit-every", "5", "--checkpoint-every", "2")
    fast = start_job(
        etcd_server,
        *flags,
        script=EA_SCRIPT,
        script_args=(*train, "--steps", "1500", "--step-delay", "0.02"),
        env=NO_SNAPSHOTS,
    )
    jobs.append(fast)
    slow = start_job(
        etcd_server,
        *flags,
        script=EA_SCRIPT,
        script_args=(*train, "--steps", "200", "--step-delay", "0.1"),
        env=NO_SNAPSHOTS,
    )
    jobs.append(slow)
    own = CheckpointDir(shared, slow.job_id)
    others = CheckpointDir(shared, fast.job_id)

    def newest_commit(folder: CheckpointDir) -> int:
        return max((c.commit_id for c in folder.checkpoints()), default=0)

    # Either job may get through its import first on a loaded machine: wait until the fast one
    # is well ahead (the slow one writes a checkpoint a second; the fast one five).
    slow.wait_for(
        lambda: (
            len(own.checkpoints()) >= 2
            and bool(slow.commits(1))
            and newest_commit(others) > newest_commit(own) + 8
        ),
        90,
        "two checkpoints of the slow job, and the fast job's newer ones",
    )
    (slot,) = {e.slot for e in slow.commits(1)}
    os.kill(slow.pid(keys.proc(slot)), signal.SIGKILL)
    # The restarted process imports TensorFlow for seconds before it loads.
    newest, previous = own.checkpoints()[:2]  # a third one only until its pruning
    meta = json.loads((previous.path / "meta.json").read_text())
    with (newest.path / ARRAYS).open("r+b") as arrays:
        arrays.truncate(arrays.seek(0, os.SEEK_END) // 2)
    assert newest_commit(others) > newest.commit_id
    assert slow.finish() == 0, slow.tail()
    assert fast.finish() == 0, fast.tail()
    (resumed,) = [e for e in slow.events if e.data.get("event") == "resumed"]
    assert resumed.data["step"] == meta["attributes"]["step"], (resumed.data, meta)
    assert any(f"{ARRAYS} is truncated" in line for line in slow.lines), slow.tail()
    assert not [e for e in fast.events if e.data.get("event") == "resumed"], fast.tail()
    assert [e.data["step"] for e in slow.done()] == [200]
    assert [e.data["step"] for e in fast.done()] == [1500]
    # Both jobs' folders hold their own last two checkpoints, written for them.
    for job, folder in ((slow, own), (fast, others)):
        stored = folder.checkpoints()
        assert len(stored) == 2, stored
        for checkpoint in stored:
            assert json.loads((checkpoint.path / "meta.json").read_text())["job_id"] == job.job_id
    assert sorted(p.name for p in shared.iterdir()) == sorted([slow.job_id, fast.job_id])
