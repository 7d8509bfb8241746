"""Item 11: a straggler -- one rank of 3 held to a CPU quota -- under ``--straggler-policy
report``, under ``evict``, and under static ``horovodrun``; and how long the launcher takes to
name it.

elastic-run: one job per policy, 3 workers, bench/scripts/hvd_steps.py (~1 M parameters) with
``elastic_allreduce.DistributedGradientTape`` (it times each rank's wait in the gradient
allreduce, which the straggler watch reads) and ``report_step``. In each job rank 0's steps/s are
counted over a window with every rank at full speed (the same job without the slow rank), then
rank 1's process is held to ``PERCENT`` % of a CPU (a cgroup quota, as a noisy neighbour or a
throttled machine would):

* detection: from the quota until the launcher's ``Straggler`` event (the events file);
* report: steps/s over the same window once named (the slow rank stays);
* evict: steps/s over the same window once the replacement node steps in the ring of 3
  (and 10 s more).

horovodrun: static, the same workload and quota on one worker, before and after.
Targets (issue #15): named within 30 s; with evict, steps/s within 10 % of the job's clean
figure.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import cgroups
from bench.horovodrun_baseline import MANY_STEPS, WORKLOAD, horovodrun_static_slowed
from bench.items.context import Context
from bench.jobs import STARTUP_LIMIT_S, BenchError, ElasticRunJob, log, step_rate
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import ProcRecord
from elastic_allreduce.store import EtcdStore

PARAMS = 1_000_000
#: The slowed rank's CPU quota, in % of one CPU.
PERCENT = 30
DETECT_TARGET_S = 30.0
#: With evict, the steps/s may be this much below the job's clean figure.
EVICT_TOLERANCE = 0.10
DETECT_LIMIT_S = 120.0
SETTLE_S = 3.0
#: Steps of rank 0 before the clean window (every process past its first, slower steps; the
#: previous job's processes gone).
WARMUP_STEPS = 150
#: Seconds after the replacement's first step before counting (its first steps are slower, and
#: the evicted node's processes are still winding down).
REPLACEMENT_SETTLE_S = 10.0


def run(ctx: Context) -> dict[str, Any]:
    if not cgroups.available():
        return {"skipped": f"no writable cgroup CPU controller at {cgroups.CPU_CGROUPS}"}
    seconds = ctx.pick(6.0, 15.0)
    report = _elastic_run(ctx, "report", seconds)
    evict = _elastic_run(ctx, "evict", seconds)
    static = horovodrun_static_slowed(seconds, 3, PARAMS, PERCENT, slowed_rank=1)
    detect = [p["detect_s"] for p in (report, evict) if p.get("detect_s") is not None]
    evict_ratio = evict["after_per_s"] / evict["clean_per_s"] if evict["clean_per_s"] else None
    return {
        "what": (
            f"rank 1 of 3 held to {PERCENT} % of a CPU; rank 0's steps/s over {seconds:g} s "
            f"windows; ~{PARAMS:,} parameters"
        ),
        "percent": PERCENT,
        "seconds": seconds,
        "report": report,
        "evict": evict,
        "horovodrun_static": static,
        "evict_ratio": evict_ratio,
        "detect_target_s": DETECT_TARGET_S,
        "evict_tolerance": EVICT_TOLERANCE,
        "detect_met": bool(detect) and max(detect) <= DETECT_TARGET_S,
        "evict_met": evict_ratio is not None and evict_ratio >= 1 - EVICT_TOLERANCE,
    }


def _elastic_run(ctx: Context, policy: str, seconds: float) -> dict[str, Any]:
    """One job under ``policy``: clean steps/s, the time to name the slowed rank, and the
    steps/s after (report: with it; evict: with its replacement)."""
    job_id = ctx.job_id(f"stragglers-{policy}")
    with (
        tempfile.TemporaryDirectory(prefix="bench-stragglers-") as folder,
        EtcdStore(ctx.endpoints, job_id) as store,
        ElasticRunJob(
            ctx.endpoints,
            job_id,
            flags=(
                *("--workers", "3", "--start-grace", "60", "--max-restarts", "3"),
                *("--straggler-policy", policy, "--events-file", str(Path(folder) / "ev")),
            ),
            script=str(WORKLOAD),
            script_args=(
                *("--steps", str(MANY_STEPS), "--params", str(PARAMS)),
                *("--ea-tape", "--report-steps"),
            ),
        ) as job,
    ):
        events = Path(folder) / "ev"
        clean = step_rate(job, seconds, 3, warmup_steps=WARMUP_STEPS, settle_s=SETTLE_S)[
            "steps_per_s"
        ]
        first = {r.source for r in job.snapshot("step") if r.data.get("size") == 3}
        victim = next(
            r.source for r in job.snapshot("step") if r.data.get("rank") == 1 and r.source in first
        )
        kv = store.get(keys.proc(victim))
        if kv is None:
            raise BenchError(f"{keys.proc(victim)} is not in the store")
        pid = ProcRecord.from_json(kv.key, kv.value).pid
        with cgroups.cpu_quota(pid, PERCENT, name=f"bench-{policy}"):
            slowed_at = time.monotonic()
            job.wait_for(lambda: bool(_stragglers(events)), DETECT_LIMIT_S, "a Straggler event")
            detect = time.monotonic() - slowed_at
            named = _stragglers(events)[0]
            log(f"stragglers, {policy}: named after {detect:.1f} s: {named.get('message')}")
            if policy == "evict":
                nodes = {slot.split(".")[0] for slot in first}
                job.wait_for(
                    lambda: any(
                        r.data.get("size") == 3 and r.source.split(".")[0] not in nodes
                        for r in job.records
                    ),
                    STARTUP_LIMIT_S,
                    "the replacement stepping in the ring of 3",
                )
                job.wait_seconds(REPLACEMENT_SETTLE_S)
            after = _rate(job, seconds)
    result = {
        "clean_per_s": clean,
        "detect_s": detect,
        "named": named.get("slots") == [victim],
        "message": named.get("message"),
        "after_per_s": after,
    }
    log(f"stragglers, {policy}: {result}")
    return result


def _stragglers(events: Path) -> list[dict[str, Any]]:
    """The Straggler events written so far."""
    try:
        lines = events.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(event, dict) and event.get("kind") == "Straggler":
            found.append(event)
    return found


def _rate(job: ElasticRunJob, seconds: float) -> float:
    """Rank 0's steps per second at size 3 over ``seconds``, after ``SETTLE_S``."""
    job.wait_seconds(SETTLE_S)
    start = time.monotonic()
    job.wait_seconds(seconds)
    window = [
        r
        for r in job.snapshot("step")
        if r.data.get("rank") == 0 and start < r.arrived <= start + seconds
    ]
    if {r.data.get("size") for r in window} != {3}:
        raise BenchError(f"rank 0 did not step at size 3 only in the window: {job.why()}")
    return len(window) / seconds
