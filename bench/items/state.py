"""Items 5 and 6: what elastic_allreduce.State costs, for models of ~1 M, ~10 M and ~50 M
parameters (dense layers, Adam: the state is the weights and two moment slots).

One ``elastic-run --workers 2`` job runs bench/scripts/state_cost.py for every model in turn,
which times on rank 0

* commit: ``State.commit()`` (in-memory copy, rank 0's progress report to etcd, the host-update
  check, a collective), as ms per commit and as a share of a commit interval (10 steps), with
  each of the three parts also timed alone; for the ~1 M model also the mean over a stretch of
  commits with the host-update votes at every commit (as before they were batched) and batched
  (the default): the target, <= 2 % of the commit interval at 1 M parameters;
* sync: ``State.sync()``, the broadcast of the committed state that a joiner receives, timed
  after a barrier: the first one of each model (the first model's is also the ring's first
  collective after ``hvd.init``, as for a joiner), and repeats. Set next to the bound S / B:
  the state's bytes over the loopback TCP bandwidth measured in the same run (item 7's figure);
* keeping the commit outside the process, per model (medians of a few rounds, each after a
  barrier): a commit with the slot's shared-memory snapshot off and on (its cost on the
  critical path), the snapshot's background write (handed to the writer thread -> written),
  ``CheckpointDir.write`` of the committed state to a temporary folder on disk (not /dev/shm),
  and loading the commit back into the model (``state_snapshots.load_newest`` with one source)
  from the snapshot and from the checkpoint (its pages dropped from the page cache first, and
  again warm), next to the peer broadcast (the sync above). Shared memory needs room for two
  snapshots per rank (the new one is written before the old one goes): 1.2 GB a rank at 50 M.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
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


def filesystem(path: str) -> str:
    """The type and mount point of the file system ``path`` is on (from /proc/self/mounts), so
    the report can say what the checkpoints were written to."""
    resolved = str(Path(path).resolve())
    best = ("?", "/")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "unknown file system"
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount, kind = fields[1], fields[2]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[1]):
            best = (kind, mount)
    return f"{best[0]} at {best[1]}"


def store_rounds(ctx: Context) -> int:
    """Rounds of the snapshot, checkpoint and restore timings per model."""
    return int(ctx.pick(1, 3))


def _one_job(ctx: Context) -> list[dict[str, Any]]:
    """One job that measures every model in turn (one TensorFlow start for all of them)."""
    # The system's temporary folder (on disk here; the report names its file system).
    with (
        tempfile.TemporaryDirectory(prefix="bench-state-ckpt-", ignore_cleanup_errors=True) as root,
        ElasticRunJob(
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
                *("--store-rounds", str(store_rounds(ctx)), "--checkpoint-root", root),
                *("--stretch-steps", str(ctx.pick(40, 100))),
            ),
        ) as job,
    ):
        code = job.finish(timeout=900)
        summaries = [r.data for r in job.snapshot("summary")]
        syncs = [r.data for r in job.snapshot("sync")]
    if code != 0 or len(summaries) != len(MODELS):
        raise BenchError(f"the state job failed (exit code {code}): {job.why()}")
    results = []
    for summary in summaries:
        mine = [s["seconds"] for s in syncs if s["bytes"] == summary["state_bytes"]]
        commit, step = summary["commit_s"], summary["step_s"]
        means = summary.get("commit_mean_s") or {}
        result = {
            **summary,
            "commit_ms": commit * 1000,
            "commit_share": commit / (commit + COMMIT_EVERY * step),
            "commit_mean_share": {
                name: mean / (mean + COMMIT_EVERY * step) for name, mean in means.items()
            },
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
        "what": (
            "elastic_allreduce.State at 2 ranks: commit cost, the state broadcast, snapshots "
            "and checkpoints"
        ),
        "commit_every": COMMIT_EVERY,
        "store_rounds": store_rounds(ctx),
        "checkpoint_filesystem": filesystem(tempfile.gettempdir()),
        "loopback_Bps": bound_Bps,
        "models": models,
        "commit_target_share": COMMIT_TARGET_SHARE,
        "commit_met": _commit_met(models),
    }


#: The target: a commit costs at most this share of a commit interval at ~1 M parameters.
COMMIT_TARGET_SHARE = 0.02


def _commit_met(models: list[dict[str, Any]]) -> bool | None:
    """Whether the smallest model's batched commits meet the target (None: not measured)."""
    shares = models[0].get("commit_mean_share", {}) if models else {}
    batched = shares.get("batched")
    return None if batched is None else batched <= COMMIT_TARGET_SHARE
