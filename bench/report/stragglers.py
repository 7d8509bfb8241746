"""Item 11: a straggler under ``--straggler-policy report`` and ``evict``, against static
horovodrun, and the time until it is named."""

from __future__ import annotations

from typing import Any

from bench.report.common import Check, fixed, met_text, table


def section(item: dict[str, Any]) -> list[str]:
    """Item 11: the slowed rank's effect under each policy, and the time to name it."""
    if "skipped" in item:
        return ["## 11. A straggler", "", f"Skipped: {item['skipped']}.", ""]
    report_, evict, static = item["report"], item["evict"], item["horovodrun_static"]
    rows = [
        [
            "elastic-run, --straggler-policy report",
            f"{report_['clean_per_s']:.1f}",
            f"{report_['after_per_s']:.1f} (the slow rank stays)",
            f"{report_['detect_s']:.1f}",
        ],
        [
            "elastic-run, --straggler-policy evict",
            f"{evict['clean_per_s']:.1f}",
            f"{evict['after_per_s']:.1f} (its node replaced)",
            f"{evict['detect_s']:.1f}",
        ],
        [
            "horovodrun, static",
            f"{static['clean']:.1f}",
            f"{static['slowed']:.1f} (nothing notices)",
            "—",
        ],
    ]
    ratio = item.get("evict_ratio")
    return [
        "## 11. A straggler",
        "",
        f"{item['what']}. A job per launcher: its steps/s with every rank at full speed (the same "
        "job without the slow rank), then with rank 1 slowed, once named (report) or once its "
        "replacement trains (evict). The launcher's message when it named the rank: "
        f"{report_.get('message')!r}.",
        "",
        *table(
            ["launcher", "steps/s, all at full speed", "steps/s, rank 1 slowed", "named after s"],
            rows,
        ),
        "",
        f"Targets: named within {item['detect_target_s']:g} s: {met_text(item['detect_met'])}; "
        f"with evict, steps/s within {item['evict_tolerance']:.0%} of the clean figure "
        f"({fixed(ratio)} of it): {met_text(item['evict_met'])}.",
        "",
    ]


def checks(item: dict[str, Any]) -> list[Check]:
    """Item 11's rows of the targets table."""
    if "skipped" in item:
        return [("stragglers", "11. straggler", None, "skipped")]
    if "report" not in item:
        return []
    detect = max(item["report"]["detect_s"], item["evict"]["detect_s"])
    return [
        (
            "straggler_detect",
            "11. straggler named",
            item["detect_met"],
            f"{detect:.1f} s at most (report and evict jobs) vs <= {item['detect_target_s']:g} s",
        ),
        (
            "straggler_evict",
            "11. straggler evicted",
            item["evict_met"],
            f"steps/s after the eviction {fixed(item.get('evict_ratio'))} of the clean job's vs >= "
            f"{1 - item['evict_tolerance']:.2f}",
        ),
    ]
