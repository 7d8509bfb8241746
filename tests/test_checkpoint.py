"""Durable checkpoints (elastic_allreduce.commits.checkpoint): real files, a real tiny full
filesystem
when this runs as root, and ea.State on real TensorFlow and Horovod in one subprocess.

What each mechanism must guarantee: a write is fsynced (files, staging folder, job folder,
LATEST) before and after its rename; only the newest K stay; a truncated or damaged newest one
is skipped, with a warning, for the previous one; a failed write (ENOSPC) is skipped and leaves
no staging folder; crashed writers' staging folders are removed; jobs sharing a root never read
or delete each other's files; another state's checkpoint is refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from elastic_allreduce.agreement.shape import VariableSpec
from elastic_allreduce.commits import checkpoint
from elastic_allreduce.commits.checkpoint import CheckpointDir, fingerprint
from elastic_allreduce.errors import ConfigError, MalformedValueError
from elastic_allreduce.records.values import DEFAULT_KEEP_CHECKPOINTS, JobConfig, JobSettings
from launcher import job_options
from tests.conftest import ROOT

FINGERPRINT = "f00d"


def arrays(commit: int, size: int = 6) -> list[np.ndarray]:
    """Two arrays whose values say which commit wrote them."""
    return [np.full(size, commit, np.float32), np.arange(3, dtype=np.int64) + commit]


def write(folder: CheckpointDir, commit: int, size: int = 6) -> checkpoint.Checkpoint | None:
    return folder.write(commit, arrays(commit, size), {"commit_id": commit}, FINGERPRINT)


def names(folder: CheckpointDir) -> list[str]:
    return sorted(entry.name for entry in folder.path.iterdir())


def commits(folder: CheckpointDir) -> list[int]:
    return [c.commit_id for c in folder.checkpoints()]


def warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# -- writing ---------------------------------------------------------------------------------------


def test_a_write_fsyncs_each_file_and_folder_around_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = CheckpointDir(tmp_path, "job-a")
    folder.path.mkdir()
    steps: list[str] = []

    def where(path: str) -> str:
        relative = os.path.relpath(path, folder.path)
        head, sep, rest = relative.partition("/")
        return ("staging" + sep + rest) if head.startswith(".staging-") else relative

    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        steps.append(f"fsync {where(os.readlink(f'/proc/self/fd/{fd}'))}")
        real_fsync(fd)

    def rename(source: str, target: str) -> None:
        steps.append(f"rename {where(str(source))} -> {where(str(target))}")
        real_rename(source, target)

    def replace(source: str, target: str) -> None:
        steps.append(f"replace {where(str(source))} -> {where(str(target))}")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    written = write(folder, 7)
    monkeypatch.undo()

    assert written is not None
    name = written.path.name
    assert name == "ckpt-00000001-commit-000000007"
    assert steps == [
        "fsync staging/arrays.npz",
        "fsync staging/meta.json",
        "fsync staging",
        f"rename staging -> {name}",
        "fsync .",
        "fsync staging",  # the LATEST pointer's temporary file
        "replace staging -> LATEST",
        "fsync .",
    ]
    # Complete files, in place; nothing left staged.
    assert names(folder) == ["LATEST", name]
    assert (folder.path / "LATEST").read_text() == f"{name}\n"
    meta = json.loads((written.path / "meta.json").read_text())
    assert meta["job_id"] == "job-a" and meta["fingerprint"] == FINGERPRINT
    assert meta["commit_id"] == 7 and meta["attributes"] == {"commit_id": 7}
    assert meta["arrays_bytes"] == (written.path / "arrays.npz").stat().st_size
    loaded = folder.load(FINGERPRINT)
    assert loaded is not None and loaded.checkpoint == written
    for got, expected in zip(loaded.arrays, arrays(7), strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_k_checkpoints_stay(tmp_path: Path, keep: int) -> None:
    folder = CheckpointDir(tmp_path, "job-a", keep=keep)
    for commit in range(1, 6):
        write(folder, commit * 10)
    assert commits(folder) == [50, 40, 30, 20, 10][:keep]
    assert (folder.path / "LATEST").read_text().strip() == folder.checkpoints()[0].path.name


def test_a_commit_reached_again_after_a_fallback_is_the_newest(tmp_path: Path) -> None:
    """Order is by write, not by commit id: a job that resumed from an older checkpoint and
    commits again must load its new checkpoint, not the older-written higher commit."""
    folder = CheckpointDir(tmp_path, "job-a", keep=3)
    write(folder, 20)
    write(folder, 10)
    loaded = folder.load(FINGERPRINT)
    assert loaded is not None and loaded.attributes == {"commit_id": 10}


def test_keep_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep_checkpoints must be at least 1, got 0"):
        CheckpointDir(tmp_path, "job-a", keep=0)


def test_attributes_that_are_not_json_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    folder = CheckpointDir(tmp_path, "job-a")
    with pytest.raises(ConfigError, match="keep them JSON values"):
        folder.write(1, arrays(1), {"commit_id": 1, "when": object()}, FINGERPRINT)
    assert not folder.path.exists()


# -- loading with fallback -------------------------------------------------------------------------


def _truncate_arrays(path: Path) -> str:
    file = path / "arrays.npz"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return "arrays.npz is truncated or damaged"


def _damage_arrays(path: Path) -> str:
    """Same size, one byte flipped inside the data: only the zip's CRC-32 sees it."""
    file = path / "arrays.npz"
    data = bytearray(file.read_bytes())
    data[len(data) // 3] ^= 0xFF
    file.write_bytes(bytes(data))
    return "arrays.npz is unreadable"


def _truncate_meta(path: Path) -> str:
    file = path / "meta.json"
    file.write_text(file.read_text()[:20])
    return "its meta.json is unreadable or truncated"


@pytest.mark.parametrize("damage", [_truncate_arrays, _damage_arrays, _truncate_meta])
def test_an_unreadable_newest_checkpoint_is_skipped_for_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], str]
) -> None:
    folder = CheckpointDir(tmp_path, "job-a", keep=2)
    write(folder, 10, size=2000)
    newest = write(folder, 20, size=2000)
    assert newest is not None
    reason = damage(newest.path)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        loaded = folder.load(FINGERPRINT)
    assert loaded is not None and loaded.checkpoint.commit_id == 10
    np.testing.assert_array_equal(loaded.arrays[0], arrays(10, 2000)[0])
    text = warnings(caplog)
    assert f"skipping checkpoint {newest.path} (commit 20): {reason}" in text
    assert "trying the previous one" in text


def test_no_usable_checkpoint_says_so_and_loads_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = CheckpointDir(tmp_path, "job-a", keep=2)
    assert folder.load(FINGERPRINT) is None  # nothing written: nothing said
    assert not warnings(caplog)
    only = write(folder, 10)
    assert only is not None
    _truncate_meta(only.path)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert folder.load(FINGERPRINT) is None
    assert "none of the 1 checkpoints" in warnings(caplog)
    assert "starting from the initial state" in warnings(caplog)


def test_another_states_checkpoint_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = CheckpointDir(tmp_path, "job-a")
    write(folder, 10)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert folder.load("other") is None
    assert "it was written for another state: fingerprint f00d" in warnings(caplog)
    assert "this state's is other; not loading it" in warnings(caplog)
    assert folder.load(FINGERPRINT) is not None


def test_the_fingerprint_is_the_variables_and_attribute_names() -> None:
    dense = [
        VariableSpec("dense/kernel:0", (4, 2), "float32"),
        VariableSpec("b:0", (2,), "float32"),
    ]
    base = fingerprint(dense, ["commit_id", "step"])
    assert base == fingerprint(dense, ["step"])  # the commit id is always there
    assert base != fingerprint(dense, ["step", "epoch"])
    assert base != fingerprint(dense[::-1], ["step"])
    assert base != fingerprint([dense[0], VariableSpec("b:0", (3,), "float32")], ["step"])
    assert base != fingerprint([dense[0], VariableSpec("b:0", (2,), "float16")], ["step"])
    assert base != fingerprint([dense[0], VariableSpec("c:0", (2,), "float32")], ["step"])


# -- jobs sharing a folder -------------------------------------------------------------------------


def test_jobs_sharing_a_root_neither_load_nor_delete_each_others_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = CheckpointDir(tmp_path, "job-a"), CheckpointDir(tmp_path, "job-b")
    for commit in range(1, 4):
        write(first, commit)
        write(second, 100 + commit)
    assert commits(first) == [3, 2] and commits(second) == [103, 102]
    assert (first.path, second.path) == (tmp_path / "job-a", tmp_path / "job-b")
    # A newer-looking checkpoint of job-b copied into job-a's folder is not job-a's.
    stray = first.path / "ckpt-00000099-commit-000000999"
    shutil.copytree(second.checkpoints()[0].path, stray)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        loaded = first.load(FINGERPRINT)
    assert loaded is not None and loaded.attributes == {"commit_id": 3}
    assert f"skipping checkpoint {stray} (commit 999): it belongs to job 'job-b'" in warnings(
        caplog
    )


def test_without_a_job_id_the_folder_is_default(tmp_path: Path) -> None:
    assert CheckpointDir(tmp_path, None).path == tmp_path / "default"
    assert CheckpointDir(tmp_path, "").path == tmp_path / "default"


# -- failed writes and staging leftovers -----------------------------------------------------------


def test_staging_leftovers_older_than_the_writer_are_removed(tmp_path: Path) -> None:
    folder = CheckpointDir(tmp_path, "job-a")
    folder.path.mkdir()

    def staged(name: str, age: float) -> Path:
        path = folder.path / name
        path.mkdir()
        (path / "arrays.npz").write_bytes(b"partial")
        stamp = time.time() - age
        os.utime(path, (stamp, stamp))
        return path

    crashed = staged(".staging-crashed", 3600)
    younger = staged(".staging-younger", -3600)  # a writer that started after this one
    assert folder.prepare()
    assert not crashed.exists() and younger.exists()
    crashed = staged(".staging-crashed-again", 3600)
    assert write(folder, 1) is not None
    assert not crashed.exists() and younger.exists()
    assert names(folder) == [".staging-younger", "LATEST", "ckpt-00000001-commit-000000001"]


def test_a_write_that_fails_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = CheckpointDir(tmp_path, "job-a")
    folder.path.write_text("a file where the job's folder goes")
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert not folder.prepare()
        assert write(folder, 1) is None
    text = warnings(caplog)
    assert f"the checkpoint folder {folder.path} is not writable" in text
    assert f"skipped the checkpoint of commit 1 in {folder.path}" in text
    assert "training goes on" in text


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only): writes there meet a real ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_skips_the_checkpoint_keeps_the_previous_ones_and_no_staging(
    tiny_filesystem: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = CheckpointDir(tiny_filesystem, "job-a", keep=2)
    # About 24 KiB each: two fit in 64 KiB, a third does not (it is pruned only once written).
    assert write(folder, 1, size=5000) is not None
    assert write(folder, 2, size=5000) is not None
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert write(folder, 3, size=5000) is None
        assert write(folder, 4, size=5000) is None
    text = warnings(caplog)
    assert "skipped the checkpoint of commit 3" in text
    assert "no space left on the device" in text and "lower --keep-checkpoints" in text
    assert names(folder) == [
        "LATEST",
        "ckpt-00000001-commit-000000001",
        "ckpt-00000002-commit-000000002",
    ]
    loaded = folder.load(FINGERPRINT)
    assert loaded is not None and loaded.checkpoint.commit_id == 2


# -- the job option, its record and ea.State -------------------------------------------------------


def parse(*flags: str) -> job_options.JobOptions:
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    return job_options.from_args(parser.parse_args([*flags, "--", "python", "train.py"]))


def test_keep_checkpoints_is_a_job_flag_that_travels_in_the_job_config() -> None:
    assert parse().keep_checkpoints == DEFAULT_KEEP_CHECKPOINTS == 2
    options = parse("--checkpoint-dir", "/ckpt", "--keep-checkpoints", "5")
    assert options.keep_checkpoints == 5
    assert parse(*job_options.to_args(options)[:-3]) == options
    with pytest.raises(ConfigError, match="--keep-checkpoints must be at least 1, got 0"):
        parse("--keep-checkpoints", "0")
    config = JobConfig(JobSettings(1, 2, 1, 0), ("python", "t.py"), "/ckpt", keep_checkpoints=5)
    assert JobConfig.from_json("k", config.to_json()) == config
    stored = config.to_json()
    assert isinstance(stored, dict)
    older = {k: v for k, v in stored.items() if k != "keep_checkpoints"}  # an older version's
    assert JobConfig.from_json("k", older).keep_checkpoints == DEFAULT_KEEP_CHECKPOINTS
    with pytest.raises(MalformedValueError, match="'keep_checkpoints' must be an integer >= 1"):
        JobConfig.from_json("k", {**older, "keep_checkpoints": 0})


def test_ea_state_writes_resumes_falls_back_refuses_and_survives_failed_writes(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "ELASTIC_ALLREDUCE_JOB_ID": "job-s",
        "ELASTIC_ALLREDUCE_KEEP_CHECKPOINTS": "3",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    for name in ("ELASTIC_ALLREDUCE_ETCD", "ELASTIC_ALLREDUCE_CHECKPOINT_DIR"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "ea_checkpoints.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Four commits, each checkpointed under ROOT/<job id>/; --keep-checkpoints 3 kept three.
    assert result["written"] == [
        "LATEST",
        "ckpt-00000002-commit-000000002",
        "ckpt-00000003-commit-000000003",
        "ckpt-00000004-commit-000000004",
    ]
    assert result["resumed_step"] == 4 and result["resumed_weights_equal"]
    assert result["fallback_step"] == 3
    assert "ckpt-00000004-commit-000000004 (commit 4): arrays.npz is truncated" in done.stderr
    assert result["other_model_step"] == 0
    assert "it was written for another state" in done.stderr
    assert result["steps_after_failed_writes"] == 2
    assert "skipped the checkpoint of commit 2" in done.stderr
    assert result["bad_keep"].startswith("ELASTIC_ALLREDUCE_KEEP_CHECKPOINTS='0'")
