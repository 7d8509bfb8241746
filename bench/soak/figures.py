"""One soak run's figures, read from what the job printed and its sample audit: exit and
accuracy, the audit's verdict, goodput, restarts and crashes by cause, and every fault made."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Sequence
from typing import Any

from bench.soak.job import SoakJob
from bench.soak.tracker import Step
from elastic_allreduce.training import audit

_ACCURACY = re.compile(r"final test accuracy: ([0-9.]+)")
_CRASH = re.compile(r"\bslot \S+ crashed: ([^;]+?)(?:; |$)")


def crash_causes(launcher_lines: Sequence[str]) -> dict[str, int]:
    """How many training processes the launchers reported crashed, by cause ("killed by
    SIGKILL": the soak's kills and the agents' kills of stopped processes; anything else was
    not the soak's doing)."""
    causes: dict[str, int] = {}
    for text in launcher_lines:
        match = _CRASH.search(text)
        if match is not None and "last output" not in match.group(1):
            causes[match.group(1)] = causes.get(match.group(1), 0) + 1
    return causes


def goodput(steps: Sequence[Step]) -> dict[str, Any]:
    """Time in the steps that were kept over the training time (first to last audit line).

    A step is kept when its ring epoch is the highest that ran it (as the audit decides); its
    time is from rank 0's audit line to rank 0's next line in the same ring (the last step of
    a ring before it ended counts nothing). Time that is not kept: rolled-back steps, re-forms,
    syncs, outages that stopped training, and the end-of-epoch evaluation of rank 0.
    """
    if not steps:
        return {"goodput": None}
    applied: dict[tuple[int, int], int] = {}
    for s in steps:
        applied[(s.epoch, s.step)] = max(applied.get((s.epoch, s.step), s.ring), s.ring)
    runs: dict[tuple[str, int], list[Step]] = {}
    for s in steps:
        runs.setdefault((s.slot, s.ring), []).append(s)
    kept = 0.0
    for run in runs.values():
        for a, b in itertools.pairwise(run):
            if a.rank == 0 and applied[(a.epoch, a.step)] == a.ring:
                kept += b.arrived - a.arrived
    span = max(s.arrived for s in steps) - min(s.arrived for s in steps)
    return {
        "goodput": kept / span if span > 0 else None,
        "kept_step_s": kept,
        "training_s": span,
        "steps_kept": len(applied),
        "steps_run": len({(s.epoch, s.step, s.ring) for s in steps}),
    }


def run_figures(job: SoakJob, code: int | None, error: str | None, samples: int) -> dict[str, Any]:
    """The run's figures: exit, accuracy, audit, goodput, restarts, faults."""
    job.tracker.close()
    reports = audit.check(job.audit_dir, samples) if any(job.audit_dir.iterdir()) else []
    launcher_lines = job.tracker.texts("launcher")
    accuracies = [m.group(1) for t in job.tracker.texts("node") if (m := _ACCURACY.search(t))]
    with job.tracker.cond:
        steps = list(job.tracker.steps)
        rings = len(job.tracker.rings)
    ended = job.ended or time.monotonic()
    return {
        "job_id": job.job_id,
        "exit_code": code,
        "error": error,
        "succeeded": code == 0 and any(" succeeded: " in t for t in launcher_lines),
        "wall_s": round(ended - job.started, 1),
        "accuracy": float(accuracies[-1]) if accuracies else None,
        "audit": {
            "epochs": len(reports),
            "complete": sorted(r.epoch for r in reports) == list(range(job.epochs)),
            "missing": sum(len(r.missing) for r in reports),
            "duplicated": sum(len(r.duplicated) for r in reports),
            "ok": bool(reports) and all(r.ok for r in reports),
        },
        **goodput(steps),
        "ring_epochs": rings,
        "restarts": sum("; restarting it (" in t for t in launcher_lines),
        "crashes": crash_causes(launcher_lines),
        "state_lost": sum("state lost" in t for t in launcher_lines),
        # Launcher faults hand the job over; a standby also takes over unasked when etcd
        # let the leader's lease expire (an outage longer than the TTL).
        "takeovers": sum("taking over job" in t for t in launcher_lines),
        "planned_takeovers": sum(f.kind in ("takeover", "adopt") for f in job.faults),
        "upkeep": job.upkeep,
        "problems": job.problems,
        "faults": [dataclasses.asdict(f) for f in job.faults],
    }
