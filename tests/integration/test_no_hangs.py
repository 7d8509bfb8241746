"""No silent hangs (issue #13): state syncs that fail instead of deadlocking, stopped processes
seen by their agent, removed slots that leave quietly. Real etcd, Horovod/Gloo, processes and
signals, as in test_elastic.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from elastic_allreduce import logprefix
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import read_job
from tests.conftest import KERAS3, ROOT
from tests.integration.harness import (
    HANG_SCRIPT,
    HVD_SCRIPT,
    UNTIL_SCRIPT,
    Job,
    run_cli,
    slot_of_rank,
    start_job,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

NO_WARMUP_SCRIPT = str(ROOT / "tests" / "scripts" / "hvd_no_warmup.py")
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
        # Its subject: a newcomer admitted before its script ran (a warm joiner has built
        # its optimizer at its ring of one by the time it joins).
        "--no-warm-join",
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
    # The first ring waits for all three (a loaded machine may start one after the default
    # grace), so the rank with the other model is in it.
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0", "--wait-timeout", "3", "--start-grace", "60"),
        script=NO_WARMUP_SCRIPT,
        script_args=("--stop-file", str(tmp_path / "stop"), "--extra-layer-on-rank", "2"),
    )
    jobs.append(job)
    # The bound is generous: the job fails, it does not hang.
    assert job.finish(120) == 1, job.tail()
    reason = job.lines[-1]
    assert "cannot sync the training state: rank 2" in reason, reason
    # Keras 3 names a variable by its path, Keras 2 by its graph name.
    name = "sequential/dense_1/kernel" if KERAS3 else "dense_1/kernel:0"
    assert f"model variable #2 is '{name}' float32 (4, 1) on rank 0" in reason, reason
    assert f"'{name}' float32 (4, 4) on rank 2" in reason, reason
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


def test_a_slot_removed_by_a_graceful_leave_exits_quietly(
    etcd_server, jobs: list[Job], tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    job = start_job(
        etcd_server,
        "--workers",
        "3",
        script=NO_WARMUP_SCRIPT,
        script_args=("--stop-file", str(stop), "--step-delay", "0.03"),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    leaver = slot_of_rank(job, 2, 3)
    os.kill(job.pid(keys.member(leaver.split(".")[0])), signal.SIGTERM)
    # Training goes on until the leave is done, however long a loaded machine takes for it.
    job.wait_for(
        lambda: (
            any(f"slot {leaver} left" in line for line in job.lines) and len(job.commits(2)) >= 2
        ),
        90,
        "the leaver gone and the others committing at size 2",
    )
    stop.touch()
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


# -- the hang watchdog (--hang-timeout) ---------------------------------------------------------

HANG_TIMEOUT = 10.0


def sleeper_line(job: Job) -> tuple[str, float]:
    """The slot that went to sleep, and when its line arrived."""
    for line in job.lines:
        parsed = logprefix.parse_line(line)
        if parsed is not None and " sleeps at step " in parsed.text:
            return parsed.slot, time.monotonic()
    raise AssertionError("no rank went to sleep:\n" + job.tail())


@pytest.mark.timeout(240)  # two cold starts, the hang timeout and the wait for the replacement
def test_a_rank_asleep_outside_a_collective_is_diagnosed_and_replaced(
    etcd_server, jobs: list[Job], tmp_path: Path
) -> None:
    # No restarts allowed: replacing a hung rank is not charged to the budget. Training ends
    # when the test says (the stop file), once the replacement trains: on a loaded machine the
    # survivors could finish a fixed number of steps before its TensorFlow import is done.
    stop = tmp_path / "stop"
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0", "--hang-timeout", str(HANG_TIMEOUT)),
        script=HANG_SCRIPT,
        script_args=(
            *("--steps", "120", "--sleep-at-step", "50", "--once", str(tmp_path / "once")),
            *("--stop-file", str(stop)),
        ),
    )
    jobs.append(job)
    job.wait_for(lambda: any(" sleeps at step 50" in line for line in job.lines), 90, "a sleeper")
    sleeper, slept_at = sleeper_line(job)
    # A liveness bound only: how fast it is found is the launcher's own figure (below).
    job.wait_for(
        lambda: any(f"slot {sleeper} hung; replacing it" in line for line in job.lines),
        HANG_TIMEOUT + 60,
        "the sleeper replaced",
    )
    replaced_at = time.monotonic()
    print(f"sleeper replaced {replaced_at - slept_at:.1f} s after the test saw its line")
    # Its replacement (the same slot, a new process) joins the ring and trains at size 3.
    job.wait_for(
        lambda: any(e.slot == sleeper and e.at > replaced_at for e in job.commits(3)),
        90,
        "the replacement to train at size 3",
    )
    stop.touch()
    assert job.finish(120) == 0, job.tail()

    hang = read_job(job.store).hang
    assert hang is not None, "no diagnosis in status/hang"
    ranks = {r.slot: r for r in hang.record.ranks}
    asleep = ranks[sleeper]
    assert asleep.rank == 1 and asleep.step == 50, asleep
    assert asleep.collective is None and asleep.where.endswith("in hang_here"), asleep
    assert "time.sleep(3600)" in asleep.stacks
    others = [r for slot, r in ranks.items() if slot != sleeper]
    # The others wait in the step's allreduce, inside the compiled step function.
    assert all(
        r.collective is not None
        and "step_fn" in r.collective
        and r.where.startswith("hang_at_step.py:")
        for r in others
    ), others
    assert "NOT in a collective, at hang_at_step.py:" in "\n".join(job.lines)
    assert f"stacks of rank 1 (slot {sleeper})" in "\n".join(job.lines)
    # And its agent asked it for its stacks before it killed it (faulthandler's own format).
    printed = [
        parsed.text
        for line in job.lines
        if (parsed := logprefix.parse_line(line)) is not None and parsed.slot == sleeper
    ]
    assert any(
        re.search(r'File ".*hang_at_step\.py", line \d+ in hang_here', text) for text in printed
    ), "\n".join(printed[-40:])
    assert_same_state_at_the_end(job, 3)
    assert {e.slot for e in job.done()} == set(ranks)  # the replacement finished too
    # It waited the whole timeout (a hang is never declared early).
    assert hang.record.stalled_for >= HANG_TIMEOUT, hang.record


def test_a_second_hang_at_the_same_place_fails_the_job_with_the_diagnosis(
    etcd_server, jobs: list[Job]
) -> None:
    # Whoever is rank 1 at step 50 sleeps: after the replacement the next rank 1 does too.
    job = start_job(
        etcd_server,
        *("--workers", "3", "--hang-timeout", str(HANG_TIMEOUT)),
        script=HANG_SCRIPT,
        script_args=("--steps", "120", "--sleep-at-step", "50"),
    )
    jobs.append(job)
    assert job.finish(150) == 1, job.tail()
    reason = job.lines[-1]
    assert "the ring hung twice at the same place" in reason, reason
    assert "NOT in a collective, at hang_at_step.py:" in reason and "in hang_here" in reason
    status = run_cli("status", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id)
    assert "last hang" in status.stdout and "failing the job" in status.stdout, status.stdout
    assert "time.sleep(3600)" in status.stdout, status.stdout


def test_a_long_first_step_and_a_marked_evaluation_are_not_hangs(
    etcd_server, jobs: list[Job]
) -> None:
    slow = str(HANG_TIMEOUT + 4)
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "0", "--hang-timeout", str(HANG_TIMEOUT)),
        script=HANG_SCRIPT,
        script_args=(
            *("--steps", "40", "--slow-first-step", slow),
            *("--slow-eval-at-step", "20", "--slow-eval", slow),
        ),
    )
    jobs.append(job)
    assert job.finish(150) == 0, job.tail()
    assert not any("no progress for" in line for line in job.lines), job.tail()
    assert read_job(job.store).hang is None
    assert_same_state_at_the_end(job, 2)


def test_status_shows_each_ranks_last_step_and_step_time(
    etcd_server, jobs: list[Job], tmp_path: Path
) -> None:
    # Trains until told to stop (600 fixed steps could end before status showed both ranks).
    stop = tmp_path / "stop"
    job = start_job(
        etcd_server,
        *("--workers", "2"),
        script=HANG_SCRIPT,
        script_args=("--steps", "20", "--step-delay", "0.02", "--stop-file", str(stop)),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 10, 90, "commits at size 2")
    ranks: list[str] = []

    def both_ranks_shown() -> bool:
        shown = run_cli("status", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id)
        ranks[:] = [line for line in shown.stdout.splitlines() if line.startswith("  rank ")]
        return len(ranks) == 2 and all(" s ago, " in line and "s/step" in line for line in ranks)

    job.wait_for(both_ranks_shown, 30, "each rank's step and step time in `elastic-run status`")
    assert all(" -- step " in line for line in ranks), ranks
    stop.touch()
    assert job.finish(120) == 0, job.tail()
