"""Item 8: the progress reporting's overhead on steady throughput (A/B rounds) and its cost timed
directly."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    Check,
    ab_check,
    ab_noise,
    ab_per_cpu,
    ab_ratio,
    ab_rounds,
    rate_table,
)


def section(item: dict[str, Any]) -> list[str]:
    cpu = item.get("cpu", {})
    off_env = " ".join(f"{k}={v}" for k, v in item.get("off_env", {}).items())
    return [
        "## 8. Progress reporting overhead",
        "",
        ab_rounds(item) + " A: reporting on (the default beacon interval, and the script calls "
        "`elastic_allreduce.progress.report_step(step)` after every step); B: reporting off "
        f"(`{off_env}`: no beacon thread, no per-step call).",
        "",
        *rate_table(
            "reporting",
            [
                ("A: on", item["reporting_on"], cpu.get("on_workers"), cpu.get("on_others")),
                ("B: off", item["reporting_off"], cpu.get("off_workers"), cpu.get("off_others")),
            ],
        ),
        "",
        *ab_ratio(item, "launcher with its rendezvous server, agents, etcd"),
        *ab_per_cpu(item, "their beacon thread"),
        *_direct(item),
        *ab_noise(item),
    ]


def _direct(item: dict[str, Any]) -> list[str]:
    direct = item.get("direct")
    if not direct or direct.get("overhead_pct") is None:
        return []
    return [
        "Timed directly in the suite's process (upper bounds, loop overhead included): one "
        f"`report_step` call {direct['report_step_cpu_s'] * 1e6:.2f} µs of CPU, one report as "
        f"the beacon sends it (build, PUT to a local server answering like the launcher, "
        f"decode the reply) {direct['report_cpu_s'] * 1e3:.2f} ms. At A's step rate and one "
        f"report a second that is {direct['cpu_per_process_s_per_s'] * 1e3:.2f} ms of CPU per "
        f"second per training process, **{direct['overhead_pct']:.2f} %** of the CPU one uses "
        f"with the reporting off ({direct['process_cpu_s_per_s']:.2f} cores).",
        "",
    ]


def check(item: dict[str, Any]) -> list[Check]:
    """Item 8's row of the targets table (none when it did not run)."""
    title = "8. progress reporting overhead"
    return ab_check(item, "progress", title, ("reporting_on", "on"), ("reporting_off", "off"))
