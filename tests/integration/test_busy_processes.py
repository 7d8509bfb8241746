"""A busy training process keeps its place (issue #43): its record lives under its node's
lease, which the agent keeps alive, so a process whose own threads cannot run for longer than
the lease TTL -- TensorFlow's import or a long trace holding the GIL, a loaded machine -- is not
taken for hung and replaced. Real etcd, Horovod/Gloo and processes, as in test_elastic.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.integration.harness import HANG_SCRIPT, Job, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: Busy loops beside the job: a load of at least 8 on this 2-core machine (niced, so that
#: they load the machine without starving the job's processes outright).
BUSY_LOOPS = 8
#: Seconds every rank holds its GIL: past the 3 s lease TTL, well inside Gloo's timeout.
HOG = 8.0


@pytest.fixture
def busy_machine() -> Iterator[None]:
    loops = [
        subprocess.Popen(
            [sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"],
            stdin=subprocess.DEVNULL,
        )
        for _ in range(BUSY_LOOPS)
    ]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait(timeout=10)


def test_a_process_that_holds_the_gil_past_the_lease_ttl_is_not_replaced(
    etcd_server, jobs: list[Job], busy_machine: None
) -> None:
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "1", "--lease-ttl", "3"),
        # Both ranks in the first ring, whenever their TensorFlow import ends on this machine.
        *("--start-grace", "120"),
        script=HANG_SCRIPT,
        script_args=(
            *("--steps", "60", "--commit-every", "5", "--step-delay", "0.02"),
            *("--hog-gil-at-step", "20", "--hog-gil", str(HOG)),
        ),
    )
    jobs.append(job)
    assert job.finish(150) == 0, job.tail()
    assert os.getloadavg()[0] >= 1.0  # the busy loops ran
    # The fault happened on both ranks ...
    held = [line for line in job.lines if "held the GIL for" in line]
    assert len(held) == 2, job.tail()
    # ... and nobody was taken for hung: no lease lost, no restart, no re-formed ring.
    for sign in ("lost its lease", "crashed", "replacing it", "(failure)"):
        assert not any(sign in line for line in job.lines), (sign, job.tail())
    done = job.done()
    assert len(done) == 2 and {e.data["step"] for e in done} == {60}, [e.data for e in done]
