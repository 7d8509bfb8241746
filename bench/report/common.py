"""What every renderer of the bench report uses: figures as text (seconds, sizes, a
``summarize()`` dict, met or missed), Markdown tables, and the paragraphs the two A/B overhead
items (8 and 10) share, so that both read alike."""

from __future__ import annotations

import statistics
from typing import Any, TypeAlias

MiB = 1024 * 1024

#: One row of the Targets table: (key of the limit shown on a miss, title, met, figure).
Check: TypeAlias = tuple[str, str, bool | None, str]


def fixed(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.1f}"


def mib_per_s(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:,.0f}"


def size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def stat(summary: dict[str, Any] | None, unit: str = " s", digits: int = 3) -> str:
    """``median (min-max), n=N`` of a summarize() dict."""
    if not summary or summary.get("n", 0) == 0:
        failed = (summary or {}).get("failed", 0)
        return f"no value ({failed} failed)" if failed else "—"
    text = (
        f"{summary['median']:.{digits}f}{unit} ({summary['min']:.{digits}f}-"
        f"{summary['max']:.{digits}f}), n={summary['n']}"
    )
    if summary.get("failed"):
        text += f", {summary['failed']} failed"
    return text


def met_text(flag: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "—"}[flag]


def rate_table(what: str, rows: list[tuple[str, Any, Any, Any]]) -> list[str]:
    """An A/B throughput table: steps/s, the training processes' CPU and the rest's, per side."""
    return table(
        [what, "steps/s: median (min-max)", "CPU of the training processes", "the rest"],
        [
            [name, stat(rate, "", 2), stat(workers, "", 2), stat(others, "", 3)]
            for name, rate, workers, others in rows
        ],
    )


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def steps_per_cpu(item: dict[str, Any], launcher: str, workers: str) -> float | None:
    """Median over rounds of steps/s divided by the cores the training processes got."""
    steps = item[launcher]["values"]
    cores = item["cpu"][workers]["values"]
    ratios = [s / c for s, c in zip(steps, cores, strict=False) if s and c]
    return statistics.median(ratios) if ratios else None


# -- the A/B overhead items (8, 10): a feature on (A) and off (B) -------------------------------


def ab_rounds(item: dict[str, Any]) -> str:
    """How an A/B item's rounds ran (the sentence before what A and B are)."""
    return (
        f"{item['what']}; {item['rounds']} alternating A/B rounds of "
        f"{item['seconds_per_round']:g} s each (the order swaps every round), a fresh job per "
        "round."
    )


def ab_ratio(item: dict[str, Any], rest: str) -> list[str]:
    """The A/B ratio against the target, per round and the rounds' own spread; ``rest``: what
    the table's "the rest" column counts."""
    per_round = ", ".join(f"{r:.3f}" for r in item.get("round_ratios", []))
    overheads = ", ".join(f"{o:+.1f} %" for o in item.get("round_overheads_pct", []))
    return [
        f"Ratio of medians A / B: {item['ratio']:.3f}, overhead (1 - A/B) = "
        f"**{item['overhead_pct']:.1f} %** (target <= {item['target_overhead_pct']:g} %: "
        f"{met_text(item['met'])}); per round A / B: {per_round} (overhead {overheads}); the "
        f"rounds' own spread: {item['noise_pct']:.1f} %. CPU in cores during the measured "
        f"windows (the rest: {rest}).",
        "",
    ]


def ab_per_cpu(item: dict[str, Any], included: str) -> list[str]:
    """Steps per CPU-second of the training processes (``included``: what of the feature runs
    in them), A against B; none when the result has no such figure."""
    per_cpu = item.get("steps_per_cpu_s", {})
    if item.get("per_cpu_overhead_pct") is None:
        return []
    return [
        f"Steps per CPU-second of the training processes, {included} included (median over "
        "rounds; less sensitive to what else the machine runs): A "
        f"{per_cpu['on']:.1f}, B {per_cpu['off']:.1f}, overhead "
        f"{item['per_cpu_overhead_pct']:.1f} %.",
        "",
    ]


def ab_noise(item: dict[str, Any], tail: str = "") -> list[str]:
    """A caveat when the rounds' own spread is larger than the target (``tail`` ends it)."""
    if item["noise_pct"] <= item["target_overhead_pct"]:
        return []
    return [
        f"The rounds' own spread ({item['noise_pct']:.1f} %) is larger than the target "
        f"({item['target_overhead_pct']:g} %): in this run the A/B figure cannot tell an "
        f"overhead of that size from noise{tail}.",
        "",
    ]


def ab_check(
    item: dict[str, Any], key: str, title: str, a: tuple[str, str], b: tuple[str, str]
) -> list[Check]:
    """An A/B item's row of the targets table (none when it did not run): the overhead, both
    sides' medians (``a``, ``b``: each side's key and the word naming it), the cost timed
    directly where there is one, and the target."""
    if "met" not in item:
        return []
    on = fixed(item[a[0]].get("median"), 2)
    off = fixed(item[b[0]].get("median"), 2)
    direct = item.get("direct", {}).get("overhead_pct")
    timed = f"; timed directly: {direct:.2f} % of a process's CPU" if direct is not None else ""
    figure = (
        f"{item['overhead_pct']:.1f} % ({a[1]} {on} vs {b[1]} {off} steps/s{timed}) "
        f"vs <= {item['target_overhead_pct']:g} %"
    )
    return [(key, title, item["met"], figure)]
