"""Snapshots in shared memory (issue 17, item 2): a ring that died while its agents lived
resumes from its last commit, without --checkpoint-dir -- on elastic_allreduce's State and on
Horovod's own TensorFlowKerasState (a plain Horovod script) alike."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from elastic_allreduce.commits import shm as shm_snapshot
from elastic_allreduce.commits.checkpoint import CheckpointDir
from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.integration.harness import (
    EA_SCRIPT,
    HVD_SCRIPT,
    Job,
    last_step_before_restart,
    start_job,
)
from tests.integration.test_elastic import (
    ALL_AT_START,
    COMMIT_EVERY,
    STEPS,
    TRAIN,
    assert_consistent_finish,
    hold,
    hold_until_back,
    kill_every_rank_after_commits,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: The ring whose every process is SIGKILLed at once while the agents live.
RANKS = 3


def test_a_ring_killed_at_once_resumes_from_its_snapshots_in_shared_memory(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Every training process of a 3-rank ring SIGKILLed at once, no checkpoint folder: the
    restarted ones load their slot's snapshot (the last commit, not step 0), nothing is
    reported lost, the job finishes with equal weights, and the agents leave no snapshot folder
    behind."""
    job = start_job(
        etcd_server,
        *("--workers", str(RANKS), "--max-restarts", str(RANKS), *ALL_AT_START),
        script=EA_SCRIPT,
        script_args=(*TRAIN, *hold(tmp_path / "hold")),
    )
    jobs.append(job)
    folder = Path(shm_snapshot.DEFAULT_ROOT) / job.job_id
    try:
        run_and_check(job, folder, tmp_path / "hold")
    finally:
        # A failed test's job is SIGKILLed with its agents, which then cannot clean up.
        shutil.rmtree(folder, ignore_errors=True)


def kill_all_after_snapshots(job: Job, folder: Path, hold_file: Path) -> tuple[int, float]:
    """Once every rank commits, check one snapshot folder per slot holding the newest commit
    only (keep 1), then SIGKILL every rank after a commit; the last step committed and when
    the ranks were killed (``time.monotonic()``). The
    restarted ring is held at its first commit until all its ranks are back in it: on a loaded
    machine a slow import could otherwise outlast the rest of the job on the others."""
    job.wait_for(lambda: len(job.commits(RANKS)) >= RANKS, 90, f"commits at size {RANKS}")
    # One folder per slot, each holding the newest snapshot only (keep 1).
    slots = sorted({e.slot for e in job.commits(RANKS)})
    assert sorted(p.name for p in folder.iterdir()) == slots
    for slot in slots:
        names = [p.name for p in (folder / slot).iterdir() if p.name.startswith("ckpt-")]
        assert len(names) == 1, names
    kill_every_rank_after_commits(job, RANKS)
    killed = time.monotonic()
    epochs = {e.epoch for e in job.commits(RANKS)}
    killed_at = max(e.data["step"] for e in job.commits(RANKS))
    hold_until_back(job, hold_file, RANKS)
    # The dead ring's last lines may have been read only now.
    last = max([killed_at, *(e.data["step"] for e in job.commits(RANKS) if e.epoch in epochs)])
    return last, killed


def run_and_check(job: Job, folder: Path, hold_file: Path) -> None:
    """Kill every rank after some commits; check the resume, the finish and the cleanup."""
    killed_at, _ = kill_all_after_snapshots(job, folder, hold_file)
    assert job.finish() == 0, job.tail()
    resumed = [e for e in job.events if e.data.get("event") == "resumed"]
    assert len(resumed) == RANKS, job.tail()
    # The last commit made (one more only if a rank was killed between its commit and the
    # line that reports it, which the script prints once the snapshot is written), never step 0
    # nor an older commit.
    steps = {e.data["step"] for e in resumed}
    assert max(steps) in (killed_at, killed_at + COMMIT_EVERY), (steps, killed_at)
    assert min(steps) >= killed_at - COMMIT_EVERY, (steps, killed_at)
    assert any("resumed from snapshot" in line for line in job.lines), job.tail()
    assert_consistent_finish(job, RANKS)  # and no "state lost"
    # Nothing lost but, at most, a starting process's lease: one that lapsed while the process
    # imported TensorFlow on a loaded machine (it registers again; issue #43's per-node lease).
    assert not [
        line
        for line in job.lines
        if "lost" in line and "launcher]" in line and "lost its lease" not in line
    ], job.tail()
    assert not folder.exists(), sorted(folder.rglob("*"))


def test_a_plain_horovod_ring_killed_at_once_resumes_from_its_snapshots_in_shared_memory(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """The same with a script written only against Horovod's elastic API: its
    TensorFlowKerasState is snapshotted at each commit (the bootstrap's hooks), every restarted
    process loads its slot's snapshot at their first sync and the ring syncs from the newest,
    so only the steps after the last commit run again; equal weights at the end, no folder
    left behind."""
    job = start_job(
        etcd_server,
        *("--workers", str(RANKS), "--max-restarts", str(RANKS), *ALL_AT_START),
        script=HVD_SCRIPT,
        script_args=(*TRAIN, "--wait-for-snapshot", *hold(tmp_path / "hold")),
    )
    jobs.append(job)
    folder = Path(shm_snapshot.DEFAULT_ROOT) / job.job_id
    try:
        run_and_check_horovod(job, folder, tmp_path / "hold")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_and_check_horovod(job: Job, folder: Path, hold_file: Path) -> None:
    """Kill every rank after some commits; the restarted ring resumes from the last commit."""
    killed_at, killed = kill_all_after_snapshots(job, folder, hold_file)
    assert job.finish() == 0, job.tail()
    # Printed at the first run of the training function, after the sync. The first restarted
    # ring holds the newest snapshot's step (one commit more only if a rank was killed between
    # its commit and the line that reports it), never step 0; a process restarted later joins
    # that ring at a later step. (A first incarnation that joined late prints it too.)
    resumed = {
        e.slot: e.data["step"]
        for e in job.events
        if e.data.get("event") == "resumed" and e.at > killed
    }
    assert len(resumed) == RANKS, job.tail()
    step = min(resumed.values())
    assert step in (killed_at, killed_at + COMMIT_EVERY), (resumed, killed_at)
    assert any("resumed from snapshot" in line for line in job.lines), job.tail()
    assert_consistent_finish(job, RANKS)
    # Only the steps after the last commit ran again: each restarted process ran the rest.
    for event in job.done():
        assert event.data["steps_run"] == STEPS - resumed[event.slot], (event.data, resumed)
    assert not folder.exists(), sorted(folder.rglob("*"))


@pytest.mark.parametrize(
    ("script", "args"),
    [(EA_SCRIPT, ("--checkpoint-every", "2")), (HVD_SCRIPT, ())],
    ids=["ea-state", "horovod-state"],
)
def test_checkpoints_persisted_by_the_agents_bring_back_a_job_whose_nodes_all_died(
    etcd_server: EmbeddedEtcd,
    jobs: list[Job],
    tmp_path: Path,
    script: str,
    args: tuple[str, ...],
) -> None:
    """With --checkpoint-dir and snapshots, rank 0 never writes a checkpoint itself: its agent
    copies the snapshot of each checkpoint commit into the job's folder -- for an
    ``elastic_allreduce.State`` and for a plain Horovod script's TensorFlowKerasState alike.
    Both nodes SIGKILLed at once (agents and processes: their snapshots are lost with them):
    the replacement nodes resume from the checkpoint an agent wrote, and the job finishes."""
    checkpoints = tmp_path / "checkpoints"
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "4", "--checkpoint-dir", str(checkpoints)),
        script=script,
        script_args=(*TRAIN, *args, *hold(tmp_path / "hold")),
    )
    jobs.append(job)
    folder = Path(shm_snapshot.DEFAULT_ROOT) / job.job_id
    try:
        job.wait_for(lambda: len(job.commits(2)) >= 12, 90, "commits at size 2")
        job.wait_for(lambda: bool(persisted(job)), 60, "a checkpoint persisted by an agent")
        slots = sorted({e.slot for e in job.commits(2)})
        nodes = sorted({keys.split_slot(slot)[0] for slot in slots})
        pids = [job.pid(keys.member(node)) for node in nodes]
        pids += [job.pid(keys.proc(slot)) for slot in slots]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        hold_until_back(job, tmp_path / "hold", 2)
        assert job.finish() == 0, job.tail()
    finally:
        # SIGKILLed agents cannot remove their slots' folders.
        shutil.rmtree(folder, ignore_errors=True)
    # The first ring of the replacements holds the checkpoint's step; a Horovod process that
    # came up later joins that ring at a later step (as in run_and_check_horovod).
    resumed = {
        e.slot: e.data["step"]
        for e in job.events
        if e.data.get("event") == "resumed" and e.at > killed
    }
    assert len(resumed) == 2, job.tail()
    killed_at = last_step_before_restart(job, 2, slots)
    # One commit more only if the kill came between a commit and the line that reports it.
    assert 0 < min(resumed.values()) <= killed_at + COMMIT_EVERY, (resumed, killed_at)
    assert any("resumed from checkpoint" in line for line in job.lines), job.tail()
    # Every checkpoint came from an agent's copy: rank 0 wrote none itself.
    assert not [line for line in job.lines if "here:" in line and "checkpoint" in line]
    assert not any("SIGTERM: writing the last commit" in line for line in job.lines)
    stored = CheckpointDir(checkpoints, job.job_id).checkpoints()
    assert len(stored) == 2, stored  # --keep-checkpoints' default
    assert {c.commit_id for c in stored} <= {c for _, c in persisted(job)}, job.tail()
    # The last commit (step 300: a checkpoint commit for both) was persisted before the
    # process exited.
    meta = json.loads((stored[0].path / "meta.json").read_text())
    assert meta["attributes"]["step"] == STEPS, meta["attributes"]
    assert_consistent_finish(job, 2, state_lost=True)


def persisted(job: Job) -> list[tuple[str, int]]:
    """(slot, commit) of every "persisted ... snapshot of commit N" line of an agent."""
    found = []
    for line in job.lines:
        match = re.search(r"persisted slot (\S+)'s snapshot of commit (\d+)", line)
        if match:
            found.append((match[1], int(match[2])))
    return found
