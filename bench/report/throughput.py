"""Item 1, steady-state throughput (elastic-run against static horovodrun, with the CPU each
used), and the fusion threshold / cycle time sweep measured with it."""

from __future__ import annotations

from typing import Any

from bench.report.common import Check, met_text, stat, steps_per_cpu, table


def section(item: dict[str, Any]) -> list[str]:
    ratios = ", ".join(f"{r:.3f}" for r in item.get("round_ratios", []))
    return [
        "## 1. Steady-state throughput",
        "",
        f"{item['what']}; {item['rounds']} alternating A/B rounds of "
        f"{item['seconds_per_round']:g} s each, a fresh job per round.",
        "",
        *table(
            ["launcher", "steps/s: median (min-max)"],
            [
                ["elastic-run", stat(item["elastic_run"], "", 2)],
                ["horovodrun --gloo (static)", stat(item["horovodrun_static"], "", 2)],
            ],
        ),
        "",
        f"Ratio of medians elastic-run / horovodrun: **{item['ratio']:.3f}** (target >= "
        f"{item['target']}: {met_text(item['met'])}); per round: {ratios}.",
        "",
        *_cpu(item),
    ]


def _cpu(item: dict[str, Any]) -> list[str]:
    cpu = item.get("cpu")
    if not cpu:
        return []
    ours = steps_per_cpu(item, "elastic_run", "elastic_run_workers")
    theirs = steps_per_cpu(item, "horovodrun_static", "horovodrun_workers")
    efficiency = (
        [
            f"Steps per CPU-second of the training processes (median over rounds; less "
            f"sensitive to what else the machine runs): elastic-run {ours:.1f}, horovodrun "
            f"{theirs:.1f}, ratio {ours / theirs:.3f}.",
            "",
        ]
        if ours and theirs
        else []
    )
    return [
        "CPU used during the measured windows, in cores: the training processes, and the rest "
        "of what the launcher runs (elastic-run: launcher, agents, etcd; horovodrun: its driver "
        "and task services).",
        "",
        *table(
            ["launcher", "training processes", "the rest"],
            [
                [
                    "elastic-run",
                    stat(cpu["elastic_run_workers"], "", 2),
                    stat(cpu["elastic_run_others"], "", 3),
                ],
                [
                    "horovodrun --gloo (static)",
                    stat(cpu["horovodrun_workers"], "", 2),
                    stat(cpu["horovodrun_others"], "", 3),
                ],
            ],
        ),
        "",
        *efficiency,
    ]


def sweep(item: dict[str, Any]) -> list[str]:
    rows = [["Horovod defaults", "", stat(item["default"], "", 2), "1.000", ""]]
    for name, variant in item["variants"].items():
        env = " ".join(f"{k}={v}" for k, v in variant["env"].items())
        per_round = ", ".join(f"{r:.3f}" for r in variant.get("vs_default_per_round", []))
        rows.append(
            [
                name,
                f"`{env}`",
                stat(variant["steps_per_s"], "", 2),
                f"{variant['vs_default']:.3f}",
                per_round,
            ]
        )
    verdict = (
        f"**{item['winner']}** beats the defaults in every round by more than "
        f"{item['winner_margin']:.1%} (the noise margin) in this run: a candidate for the default"
        + (", to be confirmed by a full run." if item["rounds"] < 2 else ".")
        if item.get("winner")
        else f"No setting beats the defaults in every round by more than "
        f"{item['winner_margin']:.1%} (the noise margin: 3 % or the defaults' own "
        "round-to-round spread): keep Horovod's defaults."
    )
    return [
        "### Fusion threshold / cycle time sweep (elastic-run, same workload)",
        "",
        f"{item['rounds']} round(s) of {item['seconds_per_round']:g} s per setting"
        + (
            "; the defaults are item 1's elastic-run rounds."
            if item.get("default_from_throughput_item")
            else ", alternating with the defaults (each round starts at another setting)."
        ),
        "",
        *table(["setting", "environment", "steps/s", "vs defaults", "per round"], rows),
        "",
        verdict,
        "",
    ]


def check(item: dict[str, Any]) -> list[Check]:
    """Item 1's row of the targets table (none when it did not run)."""
    if "met" not in item:
        return []
    return [("throughput", "1. throughput ratio", item["met"], f"{item['ratio']:.3f} vs >= 0.97")]
