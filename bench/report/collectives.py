"""Item 7: allreduce bus bandwidth by message size, against the loopback TCP bound."""

from __future__ import annotations

from typing import Any

from bench.report.common import mib_per_s, size, table


def section(item: dict[str, Any]) -> list[str]:
    series = item["series"]
    keys = list(series)
    sizes = sorted({row["bytes"] for value in series.values() for row in value["rows"]})
    rows = []
    for nbytes in sizes:
        row = [size(nbytes)]
        for key in keys:
            found = [r for r in series[key]["rows"] if r["bytes"] == nbytes]
            row.append(mib_per_s(found[0]["busbw_Bps"]) if found else "—")
        rows.append(row)
    lines = [
        "## 7. Allreduce bus bandwidth",
        "",
        f"{item['what']}. MiB/s of bus bandwidth; loopback TCP bound measured in this run: "
        f"**{mib_per_s(item['loopback_Bps'])} MiB/s** (one process streaming to another).",
        "",
        *table(["message", *(series[k]["label"] for k in keys)], rows),
        "",
    ]
    for key in keys:
        if series[key].get("library"):
            lines.append(f"- {series[key]['label']}: {series[key]['library']}")
        if series[key].get("error"):
            lines.append(f"- {series[key]['label']}: failed: {series[key]['error']}")
    if item.get("mpi_missing"):
        lines.append(f"- MPI not measured: {item['mpi_missing']}")
    ratio = item.get("median_busbw_ratio_gloo_vs_mpi_tcp")
    if ratio is not None:
        lines.append(f"- Horovod/Gloo vs MPI over TCP, median over sizes: {ratio:.2f}x")
    peaks = ", ".join(
        f"{series[k]['label']} {v:.0%}"
        for k, v in item["peak_vs_loopback"].items()
        if v is not None
    )
    lines += [
        f"- Peak bus bandwidth as a share of the loopback bound: {peaks}. The bound is that of "
        "TCP transports (Gloo, MPI with TCP only); Open MPI's defaults use shared memory "
        "between processes of one machine, which TCP does not bound.",
        "",
    ]
    return lines
