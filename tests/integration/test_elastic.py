"""Elastic jobs under `elastic-run`: real etcd, Horovod/Gloo, processes and signals.

The membership scenarios run twice: on a script written only against Horovod's elastic API, and
on one using elastic_allreduce's State.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from elastic_allreduce import env
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import read_job
from elastic_allreduce.records.values import (
    JobConfig,
    JobPhase,
    JobSettings,
    JobStatus,
    MemberRecord,
)
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from tests.conftest import fresh_job_id
from tests.integration.harness import (
    DATA_SCRIPT,
    EA_SCRIPT,
    HVD_SCRIPT,
    KERAS_SCRIPT,
    SCRIPTS,
    Job,
    join_job,
    last_step_before_restart,
    run_cli,
    run_cli_module,
    slot_of_rank,
    start_job,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 300
COMMIT_EVERY = 5
TRAIN = ("--steps", str(STEPS), "--commit-every", str(COMMIT_EVERY), "--step-delay", "0.03")
#: For tests that count every step each process ran (``steps_run``) or name the first epoch:
#: every starting worker is in the first ring, however long its first TensorFlow import takes
#: on a loaded machine (after the default 10 s the ring would start without it, and it would
#: join later with fewer steps run).
ALL_AT_START = ("--start-grace", "120")
FIXED_ARGS = (
    *("--samples", "240", "--epochs", "99", "--steps", "20", "--global-batch", "24"),
    *("--commit-every", "1", "--step-delay", "0.15"),
)


def assert_consistent_finish(job: Job, expected_slots: int, *, state_lost: bool = False) -> None:
    """Every survivor finished every step with the same weights (and, unless every holder of
    the newest commit was killed, the launcher reported no lost state)."""
    if not state_lost:
        assert not [line for line in job.lines if "state lost" in line], job.tail()
    done = job.done()
    assert len(done) == expected_slots, job.tail()
    assert {e.data["step"] for e in done} == {STEPS}
    assert len({e.data["checksum"] for e in done}) == 1, [e.data for e in done]
    # At every commit step of the final size, all ranks hold identical weights.
    final_size = done[0].data["size"]
    by_step: dict[int, set[float]] = {}
    for event in job.commits(final_size):
        by_step.setdefault(event.data["step"], set()).add(event.data["checksum"])
    assert by_step and all(len(values) == 1 for values in by_step.values()), by_step


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_sigkill_of_one_of_three_workers_continues_at_size_two(
    etcd_server: EmbeddedEtcd, jobs: list[Job], script: str
) -> None:
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0", *ALL_AT_START),
        script=script,
        script_args=TRAIN,
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    victim = slot_of_rank(job, 1, 3)
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    assert job.finish() == 0, job.tail()
    before = [e.data["step"] for e in job.commits(3) if e.slot != victim]
    after = job.commits(2)
    assert after, job.tail()
    assert {e.slot for e in after} == {e.slot for e in job.commits(3)} - {victim}
    # The survivors resumed from their last commit, not from the start.
    assert min(e.data["step"] for e in after) >= max(before)
    assert not [e for e in job.events if e.slot == victim and e.at > after[0].at]
    assert_consistent_finish(job, 2)
    # Rolled back to the last commit: at most the uncommitted steps were run twice.
    for event in job.done():
        assert STEPS <= event.data["steps_run"] <= STEPS + 2 * COMMIT_EVERY, event.data
    assert any(f"slot {victim} crashed: killed by SIGKILL" in line for line in job.lines)
    assert any(
        "epoch" in line and "running with 2 ranks; re-formed in" in line for line in job.lines
    )


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_a_joining_worker_gets_the_committed_state_and_nobody_rolls_back(
    etcd_server: EmbeddedEtcd, jobs: list[Job], script: str, tmp_path: Path
) -> None:
    """The ring waits at its commits from step 100 on until the joiner is in (a hold file):
    on a loaded machine the joiner's import could outlast the job's 300 steps."""
    hold_file = tmp_path / "hold"
    hold_file.touch()
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-workers", "3", *ALL_AT_START),
        script=script,
        script_args=(*TRAIN, "--hold-file", str(hold_file), "--hold-at", "100"),
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 4, 90, "commits at size 2")
    joiner = join_job(etcd_server, job)
    jobs.append(joiner)
    joiner.wait_for(
        lambda: any(e.data.get("size") == 3 for e in joiner.events), 120, "the joiner in the ring"
    )
    hold_file.unlink()
    joiner.wait_for(lambda: bool(joiner.commits(3)), 90, "the joiner's first commit")
    assert job.finish() == 0, job.tail()
    assert joiner.finish(30) == 0, joiner.tail()
    first = joiner.commits(3)[0]
    peers = [e for e in job.commits(3) if e.data["step"] == first.data["step"]]
    assert len(peers) == 2
    assert {e.data["checksum"] for e in peers} == {first.data["checksum"]}
    # No step was ever run twice: the members were not rolled back.
    for event in job.done():
        assert event.data["steps_run"] == STEPS, event.data
    (joined,) = joiner.done()
    assert joined.data["steps_run"] == STEPS - first.data["step"] + COMMIT_EVERY
    done = job.done() + joiner.done()
    assert len(done) == 3 and len({e.data["checksum"] for e in done}) == 1
    assert any("joined" in line for line in job.lines)


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_sigterm_to_a_worker_node_is_a_graceful_leave_without_rollback(
    etcd_server: EmbeddedEtcd, jobs: list[Job], script: str
) -> None:
    job = start_job(etcd_server, "--workers", "3", *ALL_AT_START, script=script, script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    leaver = slot_of_rank(job, 2, 3)
    node = leaver.split(".")[0]
    os.kill(job.pid(keys.member(node)), signal.SIGTERM)
    assert job.finish() == 0, job.tail()
    assert job.commits(2), job.tail()
    for event in job.done():
        assert event.data["steps_run"] == STEPS, event.data  # nobody rolled back
    assert not any("crashed" in line for line in job.lines), job.tail()
    assert any(f"node {node} is leaving gracefully" in line for line in job.lines)
    assert_consistent_finish(job, 2)


def test_a_hung_node_is_evicted_through_its_leases(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(etcd_server, "--workers", "3", "--max-restarts", "0", script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 6, 90, "commits at size 3")
    victim = slot_of_rank(job, 1, 3)
    # The whole node hangs, its agent too: only the leases can tell (an agent that runs sees
    # its stopped process and kills it within a second: tests/integration/test_no_hangs.py).
    pids = [job.pid(keys.member(victim.split(".")[0])), job.pid(keys.proc(victim))]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        job.wait_for(
            lambda: any(f"slot {victim} lost its lease" in line for line in job.lines),
            30,
            "the process's lease to expire",
        )
    finally:
        for pid in pids:  # the hung node dies (else the launcher waits for its agent at the end)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert job.finish() == 0, job.tail()
    assert not any("was stopped (SIGSTOP?)" in line for line in job.lines), job.tail()
    # The ring guard unblocked the survivors: none had to be replaced as stuck.
    assert not any("did not leave its failed collective" in line for line in job.lines), job.tail()
    assert_consistent_finish(job, 2)


def test_a_death_while_the_ring_re_forms_does_not_hang_the_job(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(etcd_server, "--workers", "4", "--max-restarts", "0", script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(4)) >= 8, 120, "commits at size 4")
    first, second = slot_of_rank(job, 1, 4), slot_of_rank(job, 2, 4)
    pids = job.pid(keys.proc(first)), job.pid(keys.proc(second))
    os.kill(pids[0], signal.SIGKILL)
    # The second death lands while the survivors are forming the next ring.
    job.wait_for(
        lambda: any("forming epoch" in line and "failure" in line for line in job.lines),
        30,
        "a re-form",
    )
    os.kill(pids[1], signal.SIGKILL)
    assert job.finish() == 0, job.tail()
    assert_consistent_finish(job, 2)


def test_fewer_than_min_workers_waits_then_fails_clearly(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(
        etcd_server,
        *("--workers", "2", "--min-workers", "2", "--max-restarts", "0", "--wait-timeout", "3"),
        script_args=TRAIN,
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 4, 90, "commits at size 2")
    os.kill(job.pid(keys.proc(slot_of_rank(job, 1, 2))), signal.SIGKILL)
    assert job.finish() == 1, job.tail()
    final = job.lines[-1]
    assert "failed: only 1 of at least 2 workers were ready for 3 s (--min-workers)" in final, final
    assert "killed by SIGKILL" in final


def test_a_script_that_always_crashes_fails_when_its_restart_fails_alike(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """A ring of one: its crash is restarted once (one rank's error could be its own), and the
    restarted process failing the same way before a step is a bug in the script (#39): the job
    fails then, with restarts left and without waiting out --wait-timeout."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import horovod.tensorflow as hvd\n"
        "hvd.init()\n"
        "raise ValueError('boom: the data file is missing')\n"
    )
    job = start_job(
        etcd_server,
        "--workers",
        "1",
        "--max-restarts",
        "5",
        "--wait-timeout",
        "300",
        script=str(script),
    )
    jobs.append(job)
    assert job.finish() == 1, job.tail()
    restarts = [line for line in job.lines if "restarting it" in line]
    assert len(restarts) == 1, job.tail()
    assert "ValueError: boom: the data file is missing" in job.lines[-1], job.lines[-1]
    assert "failed again as its predecessor did, before it trained a step" in job.lines[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--workers", "3", "--min-workers", "4"),
            "need --min-workers <= --workers <= --max-workers",
        ),
        (("--workers", "-1"), "must be 0 or more"),
        (("--lease-ttl", "0"), "--lease-ttl must be at least 1 second, got 0"),
        (
            ("--stuck-timeout", "2", "--lease-ttl", "3"),
            "--stuck-timeout (2 s) must be longer than --lease-ttl (3 s)",
        ),
        (("--etcd", "127.0.0.1:1", "--", "python", HVD_SCRIPT), "is unreachable"),
        (("--workers", "1"), "no training command"),
        (("--", "python", "missing.py"), "training script 'missing.py' does not exist"),
        (("--", "bash", "-c", "true"), "elastic-run runs Python training scripts"),
    ],
)
def test_bad_run_input_gives_one_clear_error(args: tuple[str, ...], message: str) -> None:
    result = run_cli(*args)
    # An unreachable etcd is an operational error (3), not bad input (2).
    assert result.returncode == (3 if "is unreachable" in message else 2), result
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_join_beyond_max_workers_is_refused_and_leaves_no_member(
    etcd_server: EmbeddedEtcd,
) -> None:
    job_id = fresh_job_id("full")
    with EtcdStore(etcd_server.endpoints_text, job_id) as store:
        config = JobConfig(JobSettings(1, 1, 1, 0), ("python", HVD_SCRIPT))
        store.put(keys.JOB_CONFIG, config.to_json())
        with store.grant_lease(10) as lease:
            store.create(keys.member("n0"), MemberRecord("127.0.0.1", 1).to_json(), lease=lease)
            result = run_cli("join", "--etcd", etcd_server.endpoints_text, "--job-id", job_id)
            assert result.returncode == 2, result
            assert f"job '{job_id}' already has its --max-workers 1 nodes (n0)" in result.stderr
            assert "Traceback" not in result.stderr
            assert list(read_job(store).members) == ["n0"]  # the refused node left no key


@pytest.mark.parametrize("command", ["join", "scale", "status"])
def test_unknown_job_gives_one_clear_error(etcd_server: EmbeddedEtcd, command: str) -> None:
    extra = ["3"] if command == "scale" else []
    result = run_cli(
        command, "--etcd", etcd_server.endpoints_text, "--job-id", "no-such-job", *extra
    )
    assert result.returncode == 2, result
    assert "unknown job 'no-such-job'" in result.stderr


#: Snapshots in shared memory off (elastic_allreduce.commits.shm): for the tests of what
#: happens when every process dies and only the disk, or nothing, holds the state.
NO_SNAPSHOTS = {"ELASTIC_ALLREDUCE_SNAPSHOT_ROOT": "off"}


def hold(hold_file: Path) -> tuple[str, ...]:
    """EA_SCRIPT's and HVD_SCRIPT's arguments that hold the ring at its commits while
    ``hold_file`` exists (see :func:`hold_until_back`)."""
    return ("--hold-file", str(hold_file), "--hold-at", "1")


def hold_until_back(job: Job, hold_file: Path, size: int) -> None:
    """Right after a test killed ranks: hold the ring at its next commit until a ring of
    ``size`` has formed again. On a loaded machine a restarted process's import could
    otherwise outlast the rest of a fixed-length job on the others."""
    epochs = {e.epoch for e in job.events}
    hold_file.touch()
    job.wait_for(
        lambda: any(e.data.get("size") == size and e.epoch not in epochs for e in job.events),
        120,
        f"a ring of {size} again",
    )
    hold_file.unlink()


def kill_every_rank_after_commits(job: Job, size: int = 2) -> list[str]:
    """SIGKILL every training process of a job of ``size`` workers at once, after a dozen
    commits; their slots."""
    job.wait_for(lambda: len(job.commits(size)) >= 12, 90, f"commits at size {size}")
    slots = sorted({e.slot for e in job.commits(size)})
    for pid in [job.pid(keys.proc(slot)) for slot in slots]:
        os.kill(pid, signal.SIGKILL)
    return slots


def test_the_job_resumes_from_its_checkpoint_when_every_worker_died(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "2", "--checkpoint-dir", str(checkpoints)),
        *("--keep-checkpoints", "1"),
        script=EA_SCRIPT,
        script_args=(*TRAIN, *hold(tmp_path / "hold")),
        env=NO_SNAPSHOTS,
    )
    jobs.append(job)
    slots = kill_every_rank_after_commits(job)
    hold_until_back(job, tmp_path / "hold", 2)
    assert job.finish() == 0, job.tail()
    killed_at = last_step_before_restart(job, 2, slots)
    resumed = [e for e in job.events if e.data.get("event") == "resumed"]
    assert len(resumed) == 2, job.tail()
    # Both restarted processes loaded the same checkpoint: at most a few commits back.
    assert len({e.data["step"] for e in resumed}) == 1
    step = resumed[0].data["step"]
    assert 0 < step <= killed_at
    assert killed_at - step <= 2 * COMMIT_EVERY * 2
    # The job's own folder, the newest checkpoint only (--keep-checkpoints 1), no staging left.
    folder = checkpoints / job.job_id
    assert sorted(checkpoints.iterdir()) == [folder]
    entries = sorted(p.name for p in folder.iterdir())
    assert len(entries) == 2 and entries[0] == "LATEST", entries
    assert entries[1] == (folder / "LATEST").read_text().strip()
    assert_consistent_finish(job, 2, state_lost=True)


def test_losing_every_holder_of_the_newest_commit_is_named_and_fails_the_job_when_asked(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Every training process dies at once, no checkpoint: the new ring starts from step 0,
    and the launcher says which commit and how many steps were lost (issue 17, item 4): in its
    log, as an event and in the job's failure."""
    events_file = tmp_path / "events.jsonl"
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "2", "--on-state-loss", "fail"),
        *("--events-file", str(events_file)),
        script=EA_SCRIPT,
        script_args=TRAIN,
        env=NO_SNAPSHOTS,
    )
    jobs.append(job)
    kill_every_rank_after_commits(job)
    assert job.finish() == 1, job.tail()
    lost = [line for line in job.lines if "launcher] state lost: no process holding" in line]
    assert len(lost) == 1, job.tail()
    # The newest commit named is one the killed ranks made; the new ring began at the start.
    named = re.search(r"newest commit \(commit (\d+), step (\d+)\)", lost[0])
    assert named is not None, lost[0]
    commit_id, step = int(named[1]), int(named[2])
    made = {e.data["step"] for e in job.commits(2)}
    assert step in made and step >= 12 * COMMIT_EVERY // 2, (step, sorted(made))
    assert commit_id >= 1
    assert f"restarted from the start (no checkpoint), {step} steps lost" in lost[0]
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    recorded = [e for e in events if e["kind"] == "StateLost"]
    assert len(recorded) == 1, events
    assert f"{step} steps lost" in recorded[0]["message"], recorded
    with EtcdStore(etcd_server.endpoints_text, job.job_id) as store:
        status = read_job(store).status
    assert status is not None and status.record.phase is JobPhase.FAILED
    assert status.record.reason is not None and "--on-state-loss fail" in status.record.reason
    assert f"{step} steps lost" in status.record.reason


@pytest.mark.parametrize(
    "case",
    [
        (EA_SCRIPT, (*TRAIN, "--checkpoint-every", "1000"), 6),
        # A Horovod state's periodic checkpoint is every 10th commit (5 s in, at 0.1 s a step):
        # SIGTERM comes after the 4th.
        (HVD_SCRIPT, (*TRAIN[:-1], "0.1"), 4),
    ],
    ids=["ea-state", "horovod-state"],
)
def test_sigterm_to_the_only_holder_writes_its_last_commit_and_the_restart_resumes_from_it(
    etcd_server: EmbeddedEtcd,
    jobs: list[Job],
    tmp_path: Path,
    case: tuple[str, tuple[str, ...], int],
) -> None:
    """The only training process (rank 0, the only copy of the state) is stopped with SIGTERM
    long before its next periodic checkpoint: it writes its last commit on the way out, and its
    restarted incarnation resumes from exactly there (issue 17, item 3) -- an ``ea.State`` and
    a plain Horovod script's TensorFlowKerasState alike."""
    script, args, commits = case
    job = start_job(
        etcd_server,
        *("--workers", "1", "--max-restarts", "1", "--checkpoint-dir", str(tmp_path)),
        script=script,
        script_args=args,
        env=NO_SNAPSHOTS,
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(1)) >= commits, 90, "commits at size 1")
    (slot,) = {e.slot for e in job.commits(1)}
    os.kill(job.pid(keys.proc(slot)), signal.SIGTERM)
    job.wait_for(lambda: any(e.data.get("event") == "resumed" for e in job.events), 90, "resume")
    assert job.finish() == 0, job.tail()
    (resumed,) = [e for e in job.events if e.data.get("event") == "resumed"]
    before = [e.data["step"] for e in job.commits(1) if e.at < resumed.at]
    # The newest commit the first incarnation made, not an older one and not step 0.
    assert resumed.data["step"] == max(before) >= commits * COMMIT_EVERY, (resumed.data, before)
    assert any("SIGTERM: writing the last commit" in line for line in job.lines), job.tail()
    assert_consistent_finish(job, 1)


def test_sigterm_to_the_node_of_the_only_holder_saves_its_last_commit_for_a_later_joiner(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """SIGTERM to the agent of the only node (a drain, a preemption; issue 17, item 3): no
    newcomer takes the state over before its leave times out, so its process writes the last
    commit on the way out; a node that joins later resumes from exactly there, not from an
    older checkpoint or from step 0."""
    quick_leave = {**NO_SNAPSHOTS, env.LEAVE_TIMEOUT: "3"}
    job = start_job(
        etcd_server,
        *("--workers", "1", "--max-workers", "1", "--max-restarts", "0"),
        *("--checkpoint-dir", str(tmp_path)),
        script=EA_SCRIPT,
        script_args=(*TRAIN[2:], "--steps", "600", "--checkpoint-every", "1000"),
        env=quick_leave,
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(1)) >= 6, 90, "commits at size 1")
    os.kill(job.pid(keys.member("n0")), signal.SIGTERM)
    job.wait_for(lambda: any("node n0] left the job" in line for line in job.lines), 60, "a leave")
    assert any("SIGTERM: writing the last commit" in line for line in job.lines), job.tail()
    last = max(e.data["step"] for e in job.commits(1))
    node = join_job(etcd_server, job, env=quick_leave)
    jobs.append(node)
    node.wait_for(lambda: any(e.data.get("event") == "resumed" for e in node.events), 120, "resume")
    (resumed,) = [e for e in node.events if e.data.get("event") == "resumed"]
    # The last commit printed, or the next one: SIGTERM may land between a commit and its line.
    assert resumed.data["step"] in (last, last + COMMIT_EVERY), (resumed.data, last)
    assert node.finish() == 0, node.tail()
    assert job.finish() == 0, job.tail()


def test_status_shows_the_ring_members_and_last_commit(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(
        etcd_server, "--workers", "2", *ALL_AT_START, script=EA_SCRIPT, script_args=TRAIN
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 4, 90, "commits at size 2")
    result = run_cli("status", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id)
    assert result.returncode == 0, result.stderr
    assert '"phase": "running"' in result.stdout
    assert "ring epoch 1 (running" in result.stdout
    assert "rank 0: " in result.stdout and "rank 1: " in result.stdout
    assert '"commit_id"' in result.stdout and '"size": 2' in result.stdout
    scaled = run_cli("scale", "--etcd", etcd_server.endpoints_text, "--job-id", job.job_id, "3")
    assert scaled.returncode == 2 and "--max-workers 2" in scaled.stderr
    assert job.finish() == 0, job.tail()


def test_a_second_launcher_is_refused_and_sigterm_stops_the_whole_job(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(etcd_server, "--workers", "2", script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 2, 90, "commits at size 2")
    second = run_cli(
        *("--etcd", etcd_server.endpoints_text, "--job-id", job.job_id),
        *("--workers", "1", "--", "python", HVD_SCRIPT),
    )
    assert second.returncode == 2
    assert f"job '{job.job_id}' already has a live launcher" in second.stderr
    snapshot = read_job(job.store)
    pids = [
        *(stored.record.pid for stored in snapshot.procs.values()),
        *(stored.record.pid for stored in snapshot.members.values()),
    ]
    assert len(pids) == 4
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(60) == 1
    assert "interrupted" in job.lines[-1]
    for pid in pids:
        job.wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 30, f"pid {pid} to exit")


def test_keras_fit_with_the_callbacks_survives_a_sigkill(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0"),
        script=KERAS_SCRIPT,
        script_args=("--epochs", "25"),
    )
    jobs.append(job)

    job.wait_for(lambda: len(job.epochs(3)) >= 9, 90, "three epochs at size 3")
    victim = next(e.slot for e in reversed(job.epochs(3)) if e.data["rank"] == 2)
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    assert job.finish() == 0, job.tail()
    assert job.epochs(2), job.tail()
    assert max(e.data["epoch"] for e in job.epochs(2)) == 24
    done = job.done()
    assert len(done) == 2 and len({e.data["checksum"] for e in done}) == 1, [e.data for e in done]


def test_scale_grows_then_shrinks_the_job_without_rollback(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    steps = 3 * STEPS
    train = ("--steps", str(steps), *TRAIN[2:])
    job = start_job(
        etcd_server, "--workers", "2", "--max-workers", "3", *ALL_AT_START, script_args=train
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 4, 90, "commits at size 2")
    where = ("--etcd", etcd_server.endpoints_text, "--job-id", job.job_id)
    assert run_cli("scale", *where, "3").returncode == 0
    job.wait_for(lambda: len(job.commits(3)) >= 3, 90, "commits at size 3")
    assert run_cli("scale", *where, "2").returncode == 0
    grown_at = job.commits(3)[-1].at
    job.wait_for(lambda: any(e.at > grown_at for e in job.commits(2)), 90, "size 2 again")
    assert job.finish() == 0, job.tail()
    assert any("stopping node n2 (scale-down)" in line for line in job.lines), job.tail()
    for event in job.done():
        assert event.data["steps_run"] == steps, event.data  # the first two never rolled back
    assert not any("crashed" in line for line in job.lines)


def test_every_sample_is_applied_exactly_once_through_a_kill_and_a_restart(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    audit = tmp_path / "audit"
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "1"),
        script=DATA_SCRIPT,
        # A longer step delay (0.03 s by default) leaves the restarted process, which imports
        # TensorFlow and warms up first, time to join before the data runs out (under make
        # test's load it was 1 s late).
        script_args=(
            *("--samples", "900", "--epochs", "2", "--batch-per-rank", "4", "--scale-lr"),
            *("--step-delay", "0.05"),
        ),
        env={"ELASTIC_ALLREDUCE_SAMPLE_LOG": str(audit)},
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= 9, 90, "commits at size 3")
    os.kill(job.pid(keys.proc(slot_of_rank(job, 1, 3))), signal.SIGKILL)
    job.wait_for(
        lambda: any("joined" in line for line in job.lines[-50:]), 60, "the restart to join"
    )
    assert job.finish() == 0, job.tail()
    sizes = {e.data["size"] for e in job.commits()}
    # Size 2 is usually seen too, unless a survivor stayed stuck in a collective until the
    # restart was back (the schedule tests in test_exactly_once.py pin resizes down).
    assert 3 in sizes and any("(failure)" in line for line in job.lines), job.tail(150)
    # The linear learning-rate policy followed every resize (0.05 x ranks).
    assert {(e.data["size"], e.data["lr"]) for e in job.commits()} == {
        (size, round(0.05 * size, 6)) for size in sizes
    }
    verdict = run_cli_module(
        "elastic_allreduce.training.audit", str(audit), "--samples", "900", "--epochs", "2"
    )
    assert verdict.returncode == 0, verdict.stdout
    assert verdict.stdout.count("0 missing, 0 duplicated: ok") == 2
    # The kill really rolled steps back: some global steps ran under two ring epochs.
    rings: dict[tuple[int, int], set[int]] = {}
    for path in audit.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rings.setdefault((record["epoch"], record["step"]), set()).add(record["ring"])
    assert any(len(r) > 1 for r in rings.values()), "no step was re-run after the kill"


def test_a_fixed_global_batch_matches_the_single_process_loss_at_any_size(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    def final(*flags: str, kill_at: int | None = None) -> dict[str, Any]:
        job = start_job(etcd_server, *flags, script=DATA_SCRIPT, script_args=FIXED_ARGS)
        jobs.append(job)
        if kill_at is not None:
            job.wait_for(
                lambda: len(job.commits(3)) >= 3 * kill_at, 90, f"step {kill_at} at size 3"
            )
            os.kill(job.pid(keys.proc(slot_of_rank(job, 1, 3))), signal.SIGKILL)
        assert job.finish() == 0, job.tail()
        if kill_at is not None:
            assert job.commits(2), "the job did not continue at size 2"
        results = {json.dumps(e.data["weights"]): e.data for e in job.done()}
        assert len(results) == 1, results  # every rank holds the same weights
        return next(iter(results.values()))

    single = final("--workers", "1")
    # Sizes 3 and, after the kill, 2 (a job of two from the start would show nothing more).
    # All three in the first ring: a worker that started late would join a 20-step job too
    # late for 8 steps at size 3.
    for flags, kill_at in [
        (("--workers", "3", *ALL_AT_START), None),
        (("--workers", "3", "--max-restarts", "0", *ALL_AT_START), 8),
    ]:
        result = final(*flags, kill_at=kill_at)
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-5), (flags, kill_at)
        assert result["weights"] == pytest.approx(single["weights"], rel=1e-5, abs=1e-6)


def test_the_same_command_run_again_adopts_a_job_whose_launcher_is_gone(
    etcd_server: EmbeddedEtcd,
) -> None:
    job_id = fresh_job_id("orphan")
    with EtcdStore(etcd_server.endpoints_text, job_id) as store:
        config = JobConfig(JobSettings(1, 1, 1, 0), ("python", HVD_SCRIPT))
        store.put(keys.JOB_CONFIG, config.to_json())
        store.put(keys.JOB_STATUS, JobStatus(JobPhase.RUNNING).to_json())
    result = run_cli(
        *("--etcd", etcd_server.endpoints_text, "--job-id", job_id, "--", "python", HVD_SCRIPT)
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"taking over job {job_id}, whose launcher is gone" in output
    assert f"job {job_id} succeeded" in result.stdout


def test_every_source_in_a_custom_loop_or_keras_fit_trains_the_same_model(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    # A global batch of 25 over 2 ranks: unequal shares (13 and 12), so the weighting matters.
    args = (
        *("--samples", "250", "--epochs", "99", "--steps", "16", "--global-batch", "25"),
        *("--commit-every", "4", "--step-delay", "0"),
    )
    results = {}
    for variant in [(), ("--source", "records"), ("--source", "tfrecords"), ("--keras",)]:
        # Both ranks in the first ring however long TensorFlow's import takes on a loaded
        # machine (the default grace is 10 s): the subject is the model, not the start.
        job = start_job(
            etcd_server,
            *("--workers", "2", "--start-grace", "120"),
            script=DATA_SCRIPT,
            script_args=(*args, *variant),
        )
        jobs.append(job)
        assert job.finish() == 0, job.tail()
        done = job.done()
        assert len(done) == 2 and len({json.dumps(e.data["weights"]) for e in done}) == 1
        results[variant] = done[0].data
    reference = results[()]
    assert reference["loss"] < 1.0  # it did learn something
    for variant, result in results.items():
        assert result["step"] == 16
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5), variant
        assert result["weights"] == pytest.approx(reference["weights"], rel=1e-5, abs=1e-6)
