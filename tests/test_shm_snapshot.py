"""Snapshots in shared memory (elastic_allreduce.commits.shm): the agent's folders, the
free-space checks (a fake statvfs: no tmpfs mount needed), and ea.State on real TensorFlow and
Horovod in one subprocess."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_allreduce.commits import shm as shm_snapshot
from tests.conftest import ROOT


def statvfs_with(free: int) -> shm_snapshot.StatVfs:
    """A statvfs whose file system has ``free`` bytes left."""

    def fake(path: str) -> os.statvfs_result:
        real = os.statvfs(path)
        values = list(real)
        values[0] = values[1] = 4096  # f_bsize, f_frsize
        values[4] = free // 4096  # f_bavail
        return os.statvfs_result(values)

    return fake


def test_fits_counts_the_arrays_and_the_overhead() -> None:
    small = statvfs_with(64 * 2**20)
    assert shm_snapshot.fits(12 * 2**20, "/", small)
    assert not shm_snapshot.fits(64 * 2**20, "/", small)
    assert shm_snapshot.free_bytes("/no/such/path") is None
    assert shm_snapshot.fits(2**60, "/no/such/path")  # unknown: try, ENOSPC is handled


def test_the_agent_warns_at_start_when_shared_memory_is_small(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "shm"
    with caplog.at_level(logging.WARNING):
        assert shm_snapshot.check_root(root, statvfs_with(64 * 2**20))
    assert root.stat().st_mode & 0o777 == 0o700
    text = caplog.text
    assert "only 64.0 MiB of shared memory free" in text and "--shm-size" in text
    assert "sizeLimit" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert shm_snapshot.check_root(root, statvfs_with(2**30))
    assert not caplog.text


def test_a_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root").symlink_to(tmp_path / "elsewhere")
    assert not shm_snapshot.check_root(tmp_path / "root")


def test_slot_folders_are_private_and_removed_with_the_job_folder_when_empty(
    tmp_path: Path,
) -> None:
    first = shm_snapshot.prepare_slot(tmp_path, "job", "n0.0")
    second = shm_snapshot.prepare_slot(tmp_path, "job", "n1.0")
    assert first == tmp_path / "job" / "n0.0" and second is not None
    assert first.stat().st_mode & 0o777 == 0o700
    assert shm_snapshot.prepare_slot(tmp_path, "job", "n0.0") == first  # a restart reuses it
    (first / "ckpt-00000001-commit-000000001").mkdir()
    shm_snapshot.remove_slots(tmp_path, "job", ["n0.0"])
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["n1.0"]  # another agent's
    shm_snapshot.remove_slots(tmp_path, "job", ["n1.0"])
    assert list(tmp_path.iterdir()) == []


def test_ea_state_snapshots_each_commit_loads_the_newest_and_skips_what_does_not_fit(
    tmp_path: Path,
) -> None:
    snapshots = tmp_path / "shm" / "job-s" / "n0.0"
    snapshots.mkdir(parents=True)
    env = {
        **os.environ,
        "ELASTIC_ALLREDUCE_JOB_ID": "job-s",
        "ELASTIC_ALLREDUCE_SNAPSHOT_DIR": str(snapshots),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    for name in ("ELASTIC_ALLREDUCE_ETCD", "ELASTIC_ALLREDUCE_CHECKPOINT_DIR"):
        env.pop(name, None)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "scripts" / "ea_snapshots.py"),
            str(snapshots),
            str(tmp_path / "checkpoints"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["written"] == ["ckpt-00000003-commit-000000003"]  # keep 1
    assert result["resumed_step"] == 3
    assert result["checkpoint_wins_step"] == 5
    assert result["snapshot_wins_step"] == 7
    assert result["unchanged_when_small"]
    assert done.stderr.count("snapshots skipped: a snapshot of this state") == 1
    assert "--shm-size" in done.stderr
    assert result["after_small"] == ["ckpt-00000008-commit-000000010"]
    assert "skipped the snapshot of commit 11" in done.stderr
    assert result["after_enospc"] == result["after_small"]
    assert result["step"] == 11
    # Horovod's own state under the hooks: the same snapshots, loaded at the first sync.
    assert result["horovod_written"] == ["ckpt-00000003-commit-000000003"]
    assert result["horovod_resumed"] == {
        "step": 3,
        "commit_id": 3,
        "committed_weights": True,
        "attributes": {"step": 3},
    }
