"""Horovod's documented elastic TF2 patterns run unchanged under elastic-run (issue #39).

One small script per pattern (``tests/compat/scripts/``, written here from Horovod's docs and
examples, plain Horovod: no elastic_allreduce import): a custom loop with Horovod's warm-up
(a), Keras ``fit`` (b), the synthetic benchmark's shape (c), a script's own object and metric
collectives (d), a script that commits once per epoch or never (e), local ranks for device
pinning and per-node work (f). Each runs as a real job -- real etcd, Horovod/Gloo, processes --
through a SIGKILL of one rank and the return of its restarted process, and must finish with
exit code 0 and the same final weights (their exact bytes) on every rank.

The scripts hold the ring at a commit while the test's hold file exists (``compat_events``), so
that the kill and the return land mid-training however loaded the machine.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import ROOT, installed_version
from tests.integration.harness import Event, Job, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPTS = ROOT / "tests" / "compat" / "scripts"
#: Every starting worker in the first ring however slow its first import (a loaded machine),
#: and leases that a busy process on 2 cores keeps (the subject here is not leases).
STEADY = ("--start-grace", "120", "--lease-ttl", "10", "--stuck-timeout", "45")
#: Seconds to wait for the ring to hold, and for a restarted process to be back in it.
RING_WAIT = 150.0
#: Keras 3 is the `keras` package here (TensorFlow 2.16 and later), whatever the environment says.
KERAS_3_INSTALLED = int((installed_version("keras") or "0").split(".")[0]) >= 3


def script(name: str) -> str:
    return str(SCRIPTS / name)


def job_env(hold: Path, hold_at: int) -> dict[str, str]:
    """The scripts' environment: where Keras 3 is installed, legacy Keras, as Horovod's own Keras
    API needs from TensorFlow 2.16 on (tf-keras; on Keras 3 its DistributedOptimizer is refused:
    docs/upgrading.md). TensorFlow 2.15 would look for tf-keras too if asked, so it is not."""
    return {
        **({"TF_USE_LEGACY_KERAS": "1"} if KERAS_3_INSTALLED else {}),
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(ROOT / "tests" / "scripts")]),
        "COMPAT_HOLD_FILE": str(hold),
        "COMPAT_HOLD_AT": str(hold_at),
    }


def events(job: Job, name: str) -> list[Event]:
    return [e for e in job.events if e.data.get("event") == name]


def held(job: Job, size: int) -> dict[str, set[int]]:
    """The pids that reported holding at ``size``, by slot."""
    found: dict[str, set[int]] = {}
    for event in events(job, "held"):
        if event.data.get("size") == size:
            found.setdefault(event.slot, set()).add(int(event.data["pid"]))
    return found


def kill(job: Job, slot: str) -> int:
    """SIGKILL the slot's training process; its pid."""
    pid = job.pid(keys.proc(slot))
    os.kill(pid, signal.SIGKILL)
    return pid


@dataclass(frozen=True)
class Pattern:
    script: str
    args: tuple[str, ...] = ()
    flags: tuple[str, ...] = ("--workers", "2")
    #: The ring's size, and which rank the test kills (or, when given, the slot of that index).
    size: int = 2
    victim_rank: int = 1
    hold_at: int = 2
    victim_index: int | None = None


def run_through_a_sigkill(
    etcd: EmbeddedEtcd,
    jobs: list[Job],
    tmp_path: Path,
    pattern: Pattern,
    kill_more: Callable[[Job, dict[str, int]], list[str]] = lambda job, killed: [],
) -> tuple[Job, dict[str, int]]:
    """Run ``pattern``'s job, hold its full ring, SIGKILL one rank (and whatever ``kill_more``
    kills), wait until the restarted processes hold in a full ring again, let it finish; check
    exit code 0 and equal final weights. The job, and the pids killed by slot."""
    hold = tmp_path / "hold"
    hold.touch()
    job = start_job(
        etcd,
        *("--max-restarts", "3", *STEADY),
        *pattern.flags,  # after STEADY: its own timeouts win
        script=pattern.script,
        script_args=pattern.args,
        env=job_env(hold, pattern.hold_at),
    )
    jobs.append(job)
    job.wait_for(
        lambda: len(held(job, pattern.size)) == pattern.size, RING_WAIT, "the full ring to hold"
    )
    victim = next(
        e.slot
        for e in events(job, "held")
        if e.data["size"] == pattern.size
        and (
            e.slot.endswith(f".{pattern.victim_index}")
            if pattern.victim_index is not None
            else e.data["rank"] == pattern.victim_rank
        )
    )
    killed = {victim: kill(job, victim)}
    for slot in kill_more(job, dict(killed)):
        killed[slot] = kill(job, slot)

    def back() -> bool:
        holding = held(job, pattern.size)
        return len(holding) == pattern.size and all(
            pids - {pid} for slot, pid in killed.items() for pids in [holding.get(slot, set())]
        )

    job.wait_for(back, RING_WAIT, f"{sorted(killed)} back in a ring of {pattern.size}")
    hold.unlink()
    assert job.finish(timeout=RING_WAIT) == 0, job.tail()
    done = events(job, "done")
    assert len(done) == pattern.size, job.tail()
    assert {e.data["size"] for e in done} == {pattern.size}, [e.data for e in done]
    assert len({e.data["digest"] for e in done}) == 1, [e.data for e in done]
    assert not [e for e in done if int(e.data["pid"]) in killed.values()], [e.data for e in done]
    return job, killed


def test_a_custom_loop_with_horovods_warm_up_step(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Pattern a. Failed at its first elastic step (the straggler clock's variable was made
    in the step's second trace) on every rank, and the job spent its restarts on it."""
    job, _ = run_through_a_sigkill(etcd_server, jobs, tmp_path, Pattern(script("custom_loop.py")))
    resets = events(job, "reset")
    # The reset callback rescaled the learning rate to the ring's size each time.
    assert resets and all(e.data["lr"] == pytest.approx(0.001 * e.data["size"]) for e in resets)
    assert {e.data["step"] for e in events(job, "done")} == {60}


def test_keras_fit_with_the_state_callbacks_and_a_rank_0_checkpoint(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Pattern b. The restarted process makes its ModelCheckpoint at its ring of one, where it
    is rank 0; in the ring it is rank 1 and does not write the files rank 0 writes."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    job, killed = run_through_a_sigkill(
        etcd_server,
        jobs,
        tmp_path,
        Pattern(script("keras_fit.py"), ("--checkpoint-dir", str(checkpoints))),
    )
    [victim] = killed
    assert any(
        f"slot {victim}: not saving" in line and "at rank 1" in line for line in job.lines
    ), job.tail()
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"checkpoint-{epoch}.h5" for epoch in range(1, 5)
    ]


def test_the_synthetic_benchmark_with_an_allreduce_before_its_elastic_loop(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Pattern c. The restarted process's allreduce before the elastic loop used to meet the
    survivors' state sync: the job hung for ever. It now runs at the process's ring of one."""
    job, _ = run_through_a_sigkill(
        etcd_server, jobs, tmp_path, Pattern(script("synthetic_benchmark.py"))
    )
    for event in events(job, "done"):
        assert event.data["iters"] == 12 and event.data["returned"][1] == 2, event.data


def test_without_warm_joins_the_same_script_hangs_and_the_hang_is_diagnosed(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Pattern c with --no-warm-join: the restarted process is admitted before its script
    runs, and its allreduce before the elastic loop waits beside the survivors' sync -- both
    are marked phases, which the watchdog used to trust for ever. Now ranks in different phases
    are a hang after --hang-timeout: diagnosed (who waits where) and the newcomer replaced."""
    hold = tmp_path / "hold"
    hold.touch()
    job = start_job(
        etcd_server,
        *("--workers", "2", "--max-restarts", "3", *STEADY),
        *("--no-warm-join", "--lease-ttl", "4", "--stuck-timeout", "6", "--hang-timeout", "10"),
        script=script("synthetic_benchmark.py"),
        env=job_env(hold, 2),
    )
    jobs.append(job)
    job.wait_for(lambda: len(held(job, 2)) == 2, RING_WAIT, "the full ring to hold")
    victim = next(e.slot for e in events(job, "held") if e.data["rank"] == 1)
    kill(job, victim)
    job.wait_for(
        lambda: any("while its ranks sit in different phases" in line for line in job.lines),
        RING_WAIT,
        "the watchdog to find the ranks in different phases",
    )
    job.wait_for(
        lambda: any(f"slot {victim} hung; replacing it" in line for line in job.lines),
        30,
        "the diagnosis and the newcomer's replacement",
    )
    found = next(line for line in job.lines if "different phases" in line)
    assert f"{victim} startup" in found and "sync" in found, found
    # The diagnosis names where each rank waits: the newcomer in its script's allreduce
    # before the elastic loop, the survivor in the state sync.
    assert any("synthetic_benchmark.py" in line and "train_one_batch" in line for line in job.lines)


def test_a_scripts_own_object_and_metric_collectives(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Pattern d."""
    job, _ = run_through_a_sigkill(
        etcd_server, jobs, tmp_path, Pattern(script("object_collectives.py"))
    )
    last = [e.data for e in events(job, "epoch") if e.data["epoch"] == 4]
    assert len(last) == 2 and {d["views"] for d in last} == {2}, last
    assert len({d["loss"] for d in last}) == 1, last


@pytest.mark.parametrize("commit", ["epoch", "never"])
def test_a_script_that_commits_once_per_epoch_or_never(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path, commit: str
) -> None:
    """Pattern e. Never committing, the ring hears of the joiner only when its resize times
    out (--resize-timeout, short here): its ranks are interrupted like a failed epoch and roll
    back to what the elastic run synced. That takes a ring of two or more (a ring of one has
    no connection to cut: the joiner waits, tests/test_policy.py), hence 3 workers."""
    pattern = Pattern(script("commit_policy.py"), ("--commit", commit), hold_at=8)
    if commit == "never":
        flags = ("--lease-ttl", "4", "--stuck-timeout", "6", "--resize-timeout", "10")
        pattern = replace(pattern, flags=("--workers", "3", *flags), size=3)
    job, _ = run_through_a_sigkill(etcd_server, jobs, tmp_path, pattern)
    assert {e.data["epoch"] for e in events(job, "done")} == {4}


def test_local_ranks_are_the_slots_own_through_two_kills(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    """Pattern f, with --nproc-per-node 4: slot 1 is SIGKILLed, then slot 3 while slot 1 is
    still away; every process of every slot reads its own index and 4, before its elastic run
    and in it, and the node's data is prepared once, by local rank 0."""
    nodes = tmp_path / "node"
    nodes.mkdir()

    def then_slot_3(job: Job, killed: dict[str, int]) -> list[str]:
        [(victim, pid)] = killed.items()
        # Slot 1's next process has not even reached its script yet (TensorFlow's import).
        assert not [e for e in events(job, "start") if e.slot == victim and e.data["pid"] != pid]
        return [f"{victim.rsplit('.', 1)[0]}.3"]

    pattern = Pattern(
        script("local_ranks.py"),
        ("--node-dir", str(nodes)),
        ("--workers", "1", "--nproc-per-node", "4"),
        size=4,
        victim_index=1,
    )
    job, killed = run_through_a_sigkill(etcd_server, jobs, tmp_path, pattern, then_slot_3)
    assert sorted(slot.rsplit(".", 1)[1] for slot in killed) == ["1", "3"]
    seen = [e for e in job.events if "local_rank" in e.data]
    starts = events(job, "start")
    assert len(starts) == 6, [e.data for e in starts]  # 4 first processes, 2 restarted
    for event in seen:
        index = int(event.slot.rsplit(".", 1)[1])
        assert (event.data["local_rank"], event.data["local_size"]) == (index, 4), event.data
    markers = list(nodes.iterdir())
    first_slot_0 = next(e for e in starts if e.slot.endswith(".0"))
    assert [m.name for m in markers] == [f"prepared-by-{first_slot_0.data['pid']}"]
