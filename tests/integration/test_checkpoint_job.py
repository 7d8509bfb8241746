"""A job whose checkpoint folder is on a full filesystem (issue #17, item 1): each checkpoint
that cannot be written is skipped -- by rank 0, or by the agent that copies it from the
snapshot -- training goes on to the end, and the skips are reported, in the launcher's log and
as CheckpointSkipped events."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

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
