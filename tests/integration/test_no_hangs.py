"""No silent hangs (issue #13): state syncs that fail instead of deadlocking, stopped processes
seen by their agent, removed slots that leave quietly. Real etcd, Horovod/Gloo, processes and
signals, as in test_elastic.py."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from elastic_allreduce import logprefix
from elastic_allreduce.records import keys
from tests.conftest import ROOT
from tests.integration.harness import HVD_SCRIPT, Job, slot_of_rank, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

NO_WARMUP_SCRIPT = str(ROOT / "tests" / "scripts" / "hvd_no_warmup.py")
UNTIL_SCRIPT = str(ROOT / "tests" / "scripts" / "train_until.py")
#: A script without a warm-up step: plain Horovod's TensorFlowKerasState, and ea.State.
NO_WARMUP = {
    "horovod-api": (NO_WARMUP_SCRIPT, ()),
    "elastic-allreduce-api": (UNTIL_SCRIPT, ("--no-warmup",)),
}
STEPS = 100
TRAIN = ("--steps", str(STEPS), "--commit-every", "5", "--step-delay", "0.03")


def assert_same_state_at_the_end(job: Job, ranks: int) -> None:
    """Every rank finished at the same step with the same weights."""
    done = job.done()
    assert len(done) == ranks, job.tail()
    assert len({e.data["step"] for e in done}) == 1, [e.data for e in done]
    assert len({e.data["checksum"] for e in done}) == 1, [e.data for e in done]


@pytest.mark.parametrize(("script", "extra"), NO_WARMUP.values(), ids=NO_WARMUP.keys())
def test_a_restart_without_optimizer_variables_rejoins_instead_of_deadlocking(
    etcd_server, jobs: list[Job], tmp_path: Path, script: str, extra: tuple[str, ...]
) -> None:
    stop = tmp_path / "stop"
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "1"),
        script=script,
        script_args=("--stop-file", str(stop), "--step-delay", "0.02", *extra),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    victim = slot_of_rank(job, 1, 3)
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    killed_at = time.monotonic()

    def rejoined() -> list[float]:
        return [e.at for e in job.commits(3) if e.slot == victim and e.at > killed_at]

    # Without the agreement the survivors and the restarted process wait in different
    # collectives of the sync for ever, and this times out.
    job.wait_for(lambda: len(rejoined()) >= 2, 60, "the restarted process to train at size 3")
    stop.touch()
    assert job.finish(60) == 0, job.tail()
    assert any("created the optimizer's" in line for line in job.lines), job.tail()
    assert_same_state_at_the_end(job, 3)
    # The optimizer variables created for the sync were overwritten by the broadcast.
    assert len({e.data["opt_checksum"] for e in job.done()}) == 1, [e.data for e in job.done()]


def test_ranks_with_different_models_fail_the_job_with_one_clear_reason(
    etcd_server, jobs: list[Job], tmp_path: Path
) -> None:
    # No restarts, and no wait for workers to join once every process has failed: what is
    # left to time is how fast the processes fail (the launcher's policy is the same either way).
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0", "--wait-timeout", "3"),
        script=NO_WARMUP_SCRIPT,
        script_args=("--stop-file", str(tmp_path / "stop"), "--extra-layer-on-rank", "2"),
    )
    jobs.append(job)
    # The bound is generous: the job fails, it does not hang.
    assert job.finish(60) == 1, job.tail()
    reason = job.lines[-1]
    assert "cannot sync the training state: rank 2" in reason, reason
    assert "model variable #2 is 'dense_1/kernel:0' float32 (4, 1) on rank 0" in reason, reason
    assert "'dense_1/kernel:0' float32 (4, 4) on rank 2" in reason, reason
    # Every rank raised the same error: none was left waiting in a collective.
    raised = {
        parsed.slot
        for parsed in map(logprefix.parse_line, job.lines)
        if parsed is not None and "StateMismatchError: cannot sync" in parsed.text
    }
    assert len(raised) == 3, job.tail()


def test_a_stopped_process_is_killed_by_its_agent_and_the_ring_moves_on(
    etcd_server, jobs: list[Job]
) -> None:
    job = start_job(
        etcd_server, "--workers", "3", "--max-restarts", "0", script=HVD_SCRIPT, script_args=TRAIN
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    victim = slot_of_rank(job, 1, 3)
    pid = job.pid(keys.proc(victim))
    os.kill(pid, signal.SIGSTOP)
    try:
        assert job.finish() == 0, job.tail()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stopped = f"slot {victim} was stopped (SIGSTOP?) for "
    # The agent says what it did, and the launcher's report of the exit says why.
    assert any(stopped in line and "killing it" in line for line in job.lines), job.tail()
    assert any(
        f"slot {victim} crashed: killed by SIGKILL" in line and stopped in line
        for line in job.lines
    ), job.tail()
    assert not any("lost its lease" in line for line in job.lines), job.tail()
    assert {e.slot for e in job.commits(2)} == {e.slot for e in job.commits(3)} - {victim}
    assert_same_state_at_the_end(job, 2)


def test_a_slot_removed_by_a_graceful_leave_exits_quietly(etcd_server, jobs: list[Job]) -> None:
    job = start_job(etcd_server, "--workers", "3", script=HVD_SCRIPT, script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    leaver = slot_of_rank(job, 2, 3)
    os.kill(job.pid(keys.member(leaver.split(".")[0])), signal.SIGTERM)
    assert job.finish() == 0, job.tail()
    said = [
        parsed.text
        for parsed in map(logprefix.parse_line, job.lines)
        if parsed is not None and parsed.slot == leaver
    ]
    # Horovod's abort: "terminate called after throwing ... n2.0[0] has been removed from elastic
    # job"; instead, one line of ours.
    aborted = [text for text in said if "terminate called" in text or "elastic job" in text]
    assert not aborted, aborted
    quiet = [text for text in said if "removed from the job (not a member of ring epoch" in text]
    assert len(quiet) == 1, said[-10:]
    assert any(f"slot {leaver} left (not admitted)" in line for line in job.lines), job.tail()
    assert_same_state_at_the_end(job, 2)
