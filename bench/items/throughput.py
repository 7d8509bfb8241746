"""Item 1: steady training throughput, elastic-run vs static ``horovodrun --gloo``.

The same script (bench/scripts/hvd_steps.py, ~1 M parameters) at 2 ranks, alternating A/B
rounds in one run; each round is a fresh job measured the same way (:func:`bench.jobs.step_rate`).
The ratio is median(elastic-run) / median(horovodrun). The fusion / cycle sweep runs
elastic-run with Horovod's ``HOROVOD_FUSION_THRESHOLD`` / ``HOROVOD_CYCLE_TIME`` set, also
alternating with the default settings, and reports each variant relative to the default of the
same round.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.horovodrun_baseline import MANY_STEPS, WORKLOAD, horovodrun_static_throughput
from bench.items.context import Context
from bench.jobs import BenchError, ElasticRunJob, log, step_rate, summarize

PARAMS = 1_000_000
#: Horovod settings tried against its defaults (no variable set: what elastic-run runs today).
#: Quick runs try the first two only.
VARIANTS: dict[str, dict[str, str]] = {
    "cycle 5 ms": {"HOROVOD_CYCLE_TIME": "5"},
    "fusion 4 MiB": {"HOROVOD_FUSION_THRESHOLD": str(4 * 1024 * 1024)},
    "cycle 0.1 ms": {"HOROVOD_CYCLE_TIME": "0.1"},
    "no fusion": {"HOROVOD_FUSION_THRESHOLD": "0"},
}


def twice(measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``measure()``, once more if the job failed (a worker lost to the machine's load)."""
    try:
        return measure()
    except BenchError as exc:
        log(f"throughput: a job failed, measuring again: {exc}")
        return measure()


def elastic_run_rate(
    ctx: Context, seconds: float, env: dict[str, str] | None = None, params: int = PARAMS
) -> dict[str, float]:
    """Rank 0's steps per second of ``elastic-run --workers 2`` on the workload (and CPU)."""
    return twice(lambda: _elastic_run_rate(ctx, seconds, env, params))


def _elastic_run_rate(
    ctx: Context, seconds: float, env: dict[str, str] | None, params: int
) -> dict[str, float]:
    with ElasticRunJob(
        ctx.endpoints,
        ctx.job_id("throughput"),
        # --min-workers 2: a lost worker fails the job instead of shrinking it to one rank.
        flags=("--workers", "2", "--min-workers", "2", "--max-restarts", "0"),
        script=str(WORKLOAD),
        script_args=("--steps", str(MANY_STEPS), "--params", str(params)),
        env=env,
    ) as job:
        etcd = (ctx.etcd.pid,) if ctx.etcd.pid else ()
        return step_rate(job, seconds, 2, settle_s=ctx.pick(2.0, 3.0), extra_pids=etcd)


def run(ctx: Context) -> dict[str, Any]:
    rounds = ctx.pick(2, 3)
    seconds = ctx.pick(5.0, 20.0)
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    for round_ in range(rounds):
        ours.append(elastic_run_rate(ctx, seconds))
        theirs.append(
            horovodrun_static_throughput(seconds, np_=2, params=PARAMS, settle_s=ctx.pick(2.0, 3.0))
        )
        log(f"throughput round {round_}: elastic-run {ours[-1]}, horovodrun {theirs[-1]}")
    a = [r["steps_per_s"] for r in ours]
    b = [r["steps_per_s"] for r in theirs]
    ratio = statistics.median(a) / statistics.median(b)
    return {
        "what": "steps/s of rank 0 at 2 ranks, ~1 M parameters, same script",
        "params": PARAMS,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "elastic_run": summarize(a),
        "horovodrun_static": summarize(b),
        "ratio": ratio,
        "round_ratios": [x / y for x, y in zip(a, b, strict=True)],
        # CPU in cores during the measured windows: the training processes, and the rest
        # (elastic-run: launcher, agents, etcd; horovodrun: its driver and task services).
        "cpu": {
            "elastic_run_workers": summarize([r["workers_cpu"] for r in ours]),
            "elastic_run_others": summarize([r["others_cpu"] for r in ours]),
            "horovodrun_workers": summarize([r["workers_cpu"] for r in theirs]),
            "horovodrun_others": summarize([r["others_cpu"] for r in theirs]),
        },
        "target": 0.97,
        "met": ratio >= 0.97,
    }


def run_sweep(ctx: Context) -> dict[str, Any]:
    """elastic-run throughput with each Horovod setting, against the defaults in each round."""
    names = list(VARIANTS)[: ctx.pick(2, len(VARIANTS))]
    rounds = ctx.pick(1, 2)
    seconds = ctx.pick(5.0, 10.0)
    default: list[float] = []
    rates: dict[str, list[float]] = {name: [] for name in names}
    # A quick run compares with the throughput item's elastic-run rounds (same job, window
    # and settings) instead of measuring the defaults again.
    earlier = ctx.results.get("throughput", {})
    reuse = ctx.quick and earlier.get("seconds_per_round") == seconds
    if reuse:
        default = [v for v in earlier["elastic_run"]["values"] if v is not None]
    for round_ in range(rounds):
        # Each round starts at a different setting, so no setting always runs first.
        order: list[str | None] = [None, *names] if not reuse else list(names)
        shift = round_ % len(order)
        for name in order[shift:] + order[:shift]:
            if name is None:
                default.append(elastic_run_rate(ctx, seconds)["steps_per_s"])
            else:
                rates[name].append(elastic_run_rate(ctx, seconds, VARIANTS[name])["steps_per_s"])
        log(
            f"sweep round {round_}: defaults {default[-1]:.2f}, "
            + ", ".join(f"{name} {rates[name][-1]:.2f}" for name in names)
        )
    base = statistics.median(default)
    # Per round, against the defaults of the same round (a quick run: against their median).
    paired = {
        name: [
            rate / (default[i] if not reuse and i < len(default) else base)
            for i, rate in enumerate(rates[name])
        ]
        for name in names
    }
    variants = {
        name: {
            "env": VARIANTS[name],
            "steps_per_s": summarize(rates[name]),
            "vs_default": statistics.median(rates[name]) / base,
            "vs_default_per_round": paired[name],
        }
        for name in names
    }
    best = max(variants, key=lambda name: variants[name]["vs_default"])
    # A setting "clearly wins" only if it beats the defaults in every round by more than 3 %
    # and more than the defaults' own round-to-round spread.
    spread = (max(default) - min(default)) / base if len(default) > 1 else 0.0
    margin = max(0.03, spread)
    winner = best if min(paired[best]) > 1 + margin else None
    return {
        "what": "elastic-run steps/s at 2 ranks (~1 M parameters) with Horovod settings",
        "rounds": rounds,
        "seconds_per_round": seconds,
        "default": summarize(default),
        "default_from_throughput_item": reuse,
        "variants": variants,
        "best": best,
        "winner": winner,
        "winner_margin": margin,
    }
