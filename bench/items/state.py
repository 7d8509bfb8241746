"""Items 5 and 6: what elastic_allreduce.State costs, for models of ~1 M, ~10 M and ~50 M
parameters (dense layers, Adam: the state is the weights and two moment slots).

One ``elastic-run --workers 2`` job runs bench/scripts/state_cost.py for every model in turn,
which times on rank 0

* commit: ``State.commit()`` (in-memory copy, rank 0's progress report to etcd, the host-update
  check, a collective), as ms per commit and as a share of a commit interval (10 steps), with
  each of the three parts also timed alone;
* sync: ``State.sync()``, the broadcast of the committed state that a joiner receives, timed
  after a barrier: the first one of each model (the first model's is also the ring's first
  collective after ``hvd.init``, as for a joiner), and repeats. Set next to the bound S / B:
  the state's bytes over the loopback TCP bandwidth measured in the same run (item 7's figure).
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.items.collectives import loopback_Bps
from bench.items.context import Context
from bench.jobs import SCRIPTS, BenchError, ElasticRunJob, log

SCRIPT = str(SCRIPTS / "state_cost.py")
MODELS = [1_000_000, 10_000_000, 50_000_000]
COMMIT_EVERY = 10


ATTEMPTS = 2  # a job lost to the machine's load (a lease that expired) is run once more


def measure(ctx: Context) -> list[dict[str, Any]]:
    """The figures of every model size; a second attempt if the first job failed."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return [{**model, "attempts": attempt} for model in _one_job(ctx)]
        except BenchError as exc:
            if attempt == ATTEMPTS:
                raise
            log(f"state, attempt {attempt} failed, retrying: {exc}")
    raise AssertionError("unreachable")


def _one_job(ctx: Context) -> list[dict[str, Any]]:
    """One job that measures every model in turn (one TensorFlow start for all of them)."""
    with ElasticRunJob(
        ctx.endpoints,
        ctx.job_id("state"),
        flags=(
            "--workers",
            "2",
            "--min-workers",
            "2",
            "--max-restarts",
            "0",
            "--wait-timeout",
            "5",
        ),
        script=SCRIPT,
        script_args=(
            *("--params", ",".join(map(str, MODELS)), "--steps", str(ctx.pick(12, 30))),
            *("--commit-every", str(COMMIT_EVERY), "--extra-commits", str(ctx.pick(2, 4))),
            *("--extra-syncs", str(ctx.pick(1, 3))),
        ),
    ) as job:
        code = job.finish(timeout=900)
        summaries = [r.data for r in job.snapshot("summary")]
        syncs = [r.data for r in job.snapshot("sync")]
    if code != 0 or len(summaries) != len(MODELS):
        raise BenchError(f"the state job failed (exit code {code}): {job.why()}")
    results = []
    for summary in summaries:
        mine = [s["seconds"] for s in syncs if s["bytes"] == summary["state_bytes"]]
        commit, step = summary["commit_s"], summary["step_s"]
        result = {
            **summary,
            "commit_ms": commit * 1000,
            "commit_share": commit / (commit + COMMIT_EVERY * step),
            "sync_first_s": mine[0] if mine else None,
            "sync_warm_s": statistics.median(mine[1:]) if len(mine) > 1 else None,
        }
        log(f"state, {summary['params']} parameters: {result}")
        results.append(result)
    return results


def run(ctx: Context) -> dict[str, Any]:
    bound_Bps = loopback_Bps(ctx)
    models = measure(ctx)
    for model in models:
        model["sync_bound_s"] = model["state_bytes"] / bound_Bps
    return {
        "what": "elastic_allreduce.State at 2 ranks: commit cost and the state broadcast",
        "commit_every": COMMIT_EVERY,
        "loopback_Bps": bound_Bps,
        "models": models,
    }
