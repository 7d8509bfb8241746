"""A bug in the script fails the job at once; a crash of one rank is still restarted (issue #39,
item 3). Real etcd, Horovod/Gloo and processes; the rules, step by step: tests/test_policy.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import ROOT
from tests.integration.harness import Job, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = str(ROOT / "tests" / "scripts" / "script_bug.py")
#: Every starting worker in the first ring, however slow its first import on a loaded machine.
ALL_AT_START = ("--start-grace", "120")


def test_every_rank_raising_the_same_error_fails_the_job_at_once(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    """Both ranks raise ValueError at step 3. The job fails with exit code 1 and the error in
    its last lines, with restarts left and without waiting out --wait-timeout (300 s here;
    this test's timeout is 180 s)."""
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "3", "--wait-timeout", "300", *ALL_AT_START),
        script=SCRIPT,
        script_args=("--fail-at", "3"),
    )
    jobs.append(job)
    job.wait_for(lambda: any(" crashed: " in line for line in job.lines), 120, "a crash")
    first_crash = time.monotonic()
    assert job.finish(timeout=120) == 1, job.tail()
    print(f"from the first crash to the job's end: {time.monotonic() - first_crash:.1f} s")
    last = "\n".join(job.lines[-3:])
    assert "failed alike: ValueError: bad batch at step 3 -- a bug in the script" in last, last
    assert "ValueError: bad batch at step 3" in job.lines[-1], job.lines[-1]
    assert len([line for line in job.lines if "restarting it" in line]) <= 1, job.tail()
    assert not [line for line in job.lines if "no restarts left" in line], job.tail()


def test_a_rank_that_crashes_once_is_restarted_and_the_job_finishes(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    """Only slot n1.0's first process raises (at step 3): its restart joins (the ring waits
    for it after step 3) and the job finishes with equal weights on both ranks."""
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "3", *ALL_AT_START),
        script=SCRIPT,
        script_args=(
            *("--fail-at", "3", "--fail-slot", "n1.0", "--fail-incarnations", "1"),
            *("--wait-for-size", "2"),
        ),
    )
    jobs.append(job)
    assert job.finish() == 0, job.tail()
    assert any("slot n1.0 crashed: exit code 1" in line for line in job.lines), job.tail()
    assert any("restarting it (1/3)" in line for line in job.lines), job.tail()
    done = [e.data for e in job.events if e.data.get("event") == "done"]
    assert len(done) == 2 and {d["step"] for d in done} == {40}, done
    assert len({d["checksum"] for d in done}) == 1, done


def test_a_process_whose_script_never_enters_its_elastic_run_fails_the_job_clearly(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """A process that starts once the job trained runs its script at a ring of one until its
    elastic run; one whose script ends without one (it trained alone) used to exit 0 as if it
    had finished. It now fails with one message, and its restart failing the same way before a
    step is a bug in the script."""
    stop = tmp_path / "stop"
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "3", *ALL_AT_START),
        script=str(ROOT / "tests" / "scripts" / "never_joins.py"),
        script_args=("--stop-file", str(stop)),
    )
    jobs.append(job)
    job.wait_for(
        lambda: any("epoch 1 running with 2 ranks" in line for line in job.lines),
        120,
        "the first ring",
    )
    os.kill(job.pid(keys.proc("n1.0")), signal.SIGKILL)
    assert job.finish(timeout=120) == 1, job.tail()
    never = [line for line in job.lines if "ended without entering an elastic run" in line]
    assert len(never) >= 2, job.tail()  # incarnations 2 and 3, at their rings of one
    assert "failed again as its predecessor did, before it trained a step" in job.lines[-1]
    assert "NeverJoinedError" in job.lines[-1], job.lines[-1]
