"""The PNG of the main figures: bus bandwidth (7), recovery and scale-up (2-4, 9), steps/s per
A/B round (1, 8, 10) and the state's costs against model size (5-6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report.common import MiB

#: The A/B items' lines on the steps/s plot: item, title, and per side (A, then B) its key, line
#: style and label.
_AB_LINES = (
    (
        "progress",
        "8. progress reporting overhead",
        (
            ("reporting_on", "^--", "elastic-run, progress reporting on"),
            ("reporting_off", "v--", "elastic-run, progress reporting off"),
        ),
    ),
    (
        "observability",
        "10. observability overhead",
        (
            ("observed", "D:", "elastic-run, observed"),
            ("not_observed", "d:", "elastic-run, not observed"),
        ),
    ),
)


def _plot_rates(ax: Any, items: dict[str, Any]) -> None:
    """Steps/s per A/B round: items 1 (elastic-run vs horovodrun), 8 and 10 (on vs off)."""
    throughput = items.get("throughput", {})
    if "elastic_run" in throughput:
        ours, theirs = (
            throughput["elastic_run"]["values"],
            throughput["horovodrun_static"]["values"],
        )
        ax.plot(range(1, len(ours) + 1), ours, "o-", label="elastic-run")
        ax.plot(range(1, len(theirs) + 1), theirs, "s-", label="horovodrun --gloo")
        ax.set_title(f"1. steps/s at 2 ranks, A/B rounds (ratio {throughput['ratio']:.3f})")
    for name, heading, sides in _AB_LINES:
        item = items.get(name, {})
        if sides[0][0] not in item:
            continue
        for key, style, label in sides:
            values = item[key]["values"]
            ax.plot(range(1, len(values) + 1), values, style, label=label)
        title = f"{heading} {item['overhead_pct']:.1f} %"
        ax.set_title("\n".join(t for t in (ax.get_title(), title) if t), fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set(xlabel="round", ylabel="steps/s")


def plot(results: dict[str, Any], path: Path) -> None:
    """The main figures in one PNG: bus bandwidth, recovery, throughput, state costs."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    items = results["items"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    fig.suptitle(f"elastic-allreduce bench ({results['mode']}, {results['started']})")

    ax = axes[0][0]
    allreduce = items.get("allreduce", {})
    for value in allreduce.get("series", {}).values():
        rows = value["rows"]
        if rows:
            ax.plot(
                [r["bytes"] for r in rows],
                [r["busbw_Bps"] / MiB for r in rows],
                "o-",
                label=value["label"],
            )
    if allreduce.get("loopback_Bps"):
        ax.axhline(allreduce["loopback_Bps"] / MiB, color="grey", ls="--", label="loopback TCP")
    ax.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="bus bandwidth MiB/s")
    ax.set_title("7. allreduce bus bandwidth (2 ranks)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)

    ax = axes[0][1]
    faults = items.get("faults", {})
    groups = []
    if "crash" in faults:
        crash = faults["crash"]
        groups = [
            ("elastic-run\nSIGKILL", crash["elastic_run"]),
            ("horovodrun\nSIGKILL", crash["horovodrun_elastic"]),
            ("horovodrun\nSIGKILL, 5 s", crash["horovodrun_elastic_gloo_timeout_5s"]),
            ("elastic-run\nSIGSTOP", faults["hang"]["elastic_run"]),
            ("elastic-run\nscale-up", faults["scaleup"]["elastic_run"]),
        ]
    partition = items.get("multihost", {}).get("partition")
    if partition:
        groups += [
            ("test hosts\nlink cut", partition["elastic_run"]),
            ("test hosts\nSIGKILL", partition["crash"]),
        ]
    for x, (_, summary) in enumerate(groups):
        values = [v for v in summary["values"] if v is not None]
        ax.scatter([x] * len(values), values, alpha=0.7)
        if values:
            ax.hlines(summary["median"], x - 0.3, x + 0.3, color="black")
    ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=7)
    ax.set(yscale="log", ylabel="seconds")
    ax.set_title("2-4, 9. recovery / scale-up (dots: trials, bar: median)")

    _plot_rates(axes[1][0], items)

    ax = axes[1][1]
    state = items.get("state", {})
    models = state.get("models", [])
    if models:
        params = [m["params"] for m in models]
        ax.plot(params, [m["commit_s"] for m in models], "o-", label="commit")
        ax.plot(params, [m["sync_first_s"] for m in models], "s-", label="sync (fresh ring)")
        ax.plot(params, [m["sync_bound_s"] for m in models], "--", label="bound S/B")
        ax.plot(params, [m["step_s"] for m in models], ":", label="one step")
        for label, value in (
            ("snapshot write (background)", lambda m: m.get("snapshot_write_s")),
            ("checkpoint write", lambda m: m.get("checkpoint_write_s")),
            ("restore from snapshot", lambda m: m.get("restore_s", {}).get("snapshot")),
        ):
            points = [(m["params"], value(m)) for m in models if value(m) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), "x-.", label=label)
        ax.legend(fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="seconds")
    ax.set_title("5-6. commit, state broadcast, snapshot and checkpoint vs model size")

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
