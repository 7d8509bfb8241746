"""Nothing trains alone silently (issue #41): ranks that see different data end every step
with equal weights -- with Keras 3 or legacy Keras, in a custom loop and in ``fit`` -- and
Horovod's own ``DistributedOptimizer``, which Keras 3 never lets reduce, is refused with one
clear error before the first step.

Each job is real: elastic-run, etcd, two processes on Horovod/Gloo (tests/scripts/
keras_reduces.py). The control (``--wrapper none``: no averaging) shows that the comparison
tells: its ranks end their steps with different weights.
"""

from __future__ import annotations

import os
import signal

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import KERAS3, ROOT, installed_version
from tests.integration.harness import KERAS_SCRIPT, Job, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(ROOT / "tests" / "scripts" / "keras_reduces.py")
ALL_AT_START = ("--workers", "2", "--start-grace", "120", "--max-restarts", "0")


#: Legacy Keras beside Keras 3 (the new stack's tf-keras): its patterns are run too.
LEGACY_TOO = KERAS3 and installed_version("tf-keras") is not None


def run(etcd: EmbeddedEtcd, jobs: list[Job], *args: str, legacy: bool = False) -> Job:
    job = start_job(
        etcd,
        *ALL_AT_START,
        script=SCRIPT,
        script_args=args,
        env={"TF_USE_LEGACY_KERAS": "1"} if legacy else None,
    )
    jobs.append(job)
    return job


def checksums_by_step(job: Job) -> dict[int, dict[int, float]]:
    found: dict[int, dict[int, float]] = {}
    for event in job.events:
        data = event.data
        if data.get("event") == "step" and data.get("size") == 2:
            found.setdefault(int(data["step"]), {})[int(data["rank"])] = float(data["checksum"])
    return found


def losses(job: Job, rank: int) -> list[float]:
    return [
        float(e.data["loss"])
        for e in job.events
        if e.data.get("event") == "step" and e.data.get("rank") == rank
    ]


CASES = [
    pytest.param("loop", "ea", False, id="keras-loop-ea"),
    pytest.param("fit", "ea", False, id="keras-fit-ea"),
    pytest.param("loop", "horovod", False, id="keras-loop-horovod-tape"),
]
if not KERAS3:
    CASES.append(pytest.param("fit", "horovod", False, id="keras2-fit-horovod"))
if LEGACY_TOO:
    CASES += [
        pytest.param("fit", "horovod", True, id="legacy-keras-fit-horovod"),
        pytest.param("loop", "horovod", True, id="legacy-keras-loop-horovod"),
        pytest.param("fit", "ea", True, id="legacy-keras-fit-ea"),
    ]


@pytest.mark.parametrize(("mode", "wrapper", "legacy"), CASES)
def test_ranks_with_different_data_end_every_step_equal(
    etcd_server: EmbeddedEtcd, jobs: list[Job], mode: str, wrapper: str, legacy: bool
) -> None:
    job = run(etcd_server, jobs, "--mode", mode, "--wrapper", wrapper, legacy=legacy)
    assert job.finish() == 0, job.tail()
    steps = checksums_by_step(job)
    assert sorted(steps) == list(range(1, 7)), job.tail()
    for step, by_rank in steps.items():
        assert sorted(by_rank) == [0, 1], (step, by_rank)
        assert by_rank[0] == by_rank[1], f"step {step}: the ranks differ: {by_rank}"
    # The first weights differ from the last: the steps did train.
    assert steps[1][0] != steps[6][0], steps


def test_the_control_without_averaging_ends_steps_with_different_weights(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    """``--wrapper none``: each rank applies its own gradients. The same comparison as above
    finds the ranks apart after the first step (so it would find a wrapper that skipped the
    allreduce)."""
    job = run(etcd_server, jobs, "--mode", "fit", "--wrapper", "none")
    assert job.finish() == 0, job.tail()
    steps = checksums_by_step(job)
    assert steps[1][0] != steps[1][1], steps


@pytest.mark.skipif(not KERAS3, reason="tf.keras is Keras 2 here: Horovod's wrapper reduces")
def test_horovods_distributed_optimizer_around_a_keras3_optimizer_is_refused(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    """Keras 3 never calls the hook in which Horovod's DistributedOptimizer averages: the
    wrapper is refused on both ranks, before any step, with the fix named; the job fails at
    once as a bug of the script (exit code 1, no restart)."""
    job = run(etcd_server, jobs, "--mode", "fit", "--wrapper", "horovod")
    assert job.finish() == 1, job.tail()
    assert not checksums_by_step(job), job.tail()
    text = "\n".join(job.lines)
    assert "cannot wrap a Keras 3 optimizer (SGD)" in text, job.tail()
    assert "use elastic_allreduce.DistributedOptimizer" in text, job.tail()
    assert "TF_USE_LEGACY_KERAS=1" in text, job.tail()


def test_keras_fit_through_a_sigkill_and_a_rejoin_ends_equal_with_a_lower_loss(
    etcd_server: EmbeddedEtcd, jobs: list[Job]
) -> None:
    """tests/scripts/ea_keras_fit.py (ea.State, ea.DistributedOptimizer, the three state
    callbacks) on this stack's Keras: one of two ranks is SIGKILLed, its restarted process
    rejoins, and the job ends with exit code 0, equal weights and a loss below the first
    epoch's."""
    job = start_job(
        etcd_server,
        *("--workers", "2", "--start-grace", "120", "--max-restarts", "1"),
        script=KERAS_SCRIPT,
        script_args=("--epochs", "120"),
    )
    jobs.append(job)

    job.wait_for(lambda: len(job.epochs(2)) >= 6, 120, "three epochs at size 2")
    victim = next(e.slot for e in reversed(job.epochs(2)) if e.data["rank"] == 1)
    killed_at = len(job.events)
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)

    def after(start: int, size: int) -> int | None:
        return next(
            (i for i, e in enumerate(job.events) if i > start and e.data.get("size") == size), None
        )

    job.wait_for(lambda: after(killed_at, 1) is not None, 60, "an epoch of the survivor alone")
    alone = after(killed_at, 1)
    assert alone is not None
    job.wait_for(lambda: after(alone, 2) is not None, 150, "the rejoin")
    assert job.finish(timeout=180) == 0, job.tail()
    done = job.done()
    assert len(done) == 2 and len({e.data["checksum"] for e in done}) == 1, [e.data for e in done]
    losses = [e.data["loss"] for e in job.events if e.data.get("event") == "epoch"]
    assert losses[-1] < losses[0], losses
