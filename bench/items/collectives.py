"""Item 7: allreduce bus bandwidth vs message size; the loopback TCP bound of the same run.

* Horovod/Gloo as our workers run it: bench/scripts/allreduce_bw.py under ``elastic-run
  --workers 2`` (default Horovod settings, and the fusion/cycle sweep's winner if there is one);
* MPI: the same script with ``--mpi`` (mpi4py over the distribution's Open MPI) under
  ``mpirun -np 2``, with Open MPI's default transports (shared memory on one machine) and with
  TCP only (``--mca btl self,tcp``, the transport Gloo uses);
* loopback TCP: bench/scripts/tcp_loopback.py, one process streaming to another.

Bus bandwidth is the usual allreduce figure: algbw = bytes / time per operation,
busbw = algbw * 2 (n - 1) / n.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from typing import Any

from bench.items.context import Context
from bench.jobs import SCRIPTS, BenchError, ElasticRunJob, LineJob, log, summarize

SCRIPT = str(SCRIPTS / "allreduce_bw.py")
KIB = 1024
MIB = 1024 * KIB
QUICK_SIZES = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 256 * MIB]
FULL_SIZES = [4 * KIB * 4**k for k in range(9)]  # 4 KiB ... 256 MiB
RANKS = 2
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _bus(records: list[dict[str, Any]], ranks: int) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        per_op = record["seconds"] / record["reps"]
        algbw = record["bytes"] / per_op
        rows.append(
            {
                "bytes": record["bytes"],
                "reps": record["reps"],
                "time_per_op_s": per_op,
                "algbw_Bps": algbw,
                "busbw_Bps": algbw * 2 * (ranks - 1) / ranks,
            }
        )
    return rows


def _script_args(ctx: Context) -> list[str]:
    sizes = ctx.pick(QUICK_SIZES, FULL_SIZES)
    budget = ctx.pick(64 * MIB, 512 * MIB)
    warmup = ctx.pick(1, 2)
    return ["--sizes", ",".join(map(str, sizes)), "--budget", str(budget), "--warmup", str(warmup)]


def horovod(ctx: Context, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with ElasticRunJob(
        ctx.endpoints,
        ctx.job_id("allreduce"),
        flags=("--workers", str(RANKS), "--min-workers", str(RANKS), "--max-restarts", "0"),
        script=SCRIPT,
        script_args=_script_args(ctx),
        env=env,
    ) as job:
        code = job.finish(timeout=600)
        if code != 0:
            raise BenchError(f"the Horovod allreduce job failed (exit code {code}): {job.why()}")
        return _bus([r.data for r in job.snapshot("allreduce")], RANKS)


def mpi_available() -> str | None:
    """Why MPI cannot be measured here, or None when mpirun and mpi4py are both present."""
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (scripts/setup-bench.sh installs Open MPI)"
    probe = subprocess.run(
        [sys.executable, "-c", "import mpi4py"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return "mpi4py is not installed (scripts/setup-bench.sh installs it)"
    return None


def mpi(ctx: Context, transports: str | None) -> tuple[str, list[dict[str, Any]]]:
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(RANKS)]
    command += ["--bind-to", "none"]
    if transports:
        command += ["--mca", "btl", transports]
    command += [sys.executable, SCRIPT, "--mpi", *_script_args(ctx)]
    with _MpiJob(command, MPI_ENV) as job:
        log("mpi: " + " ".join(command))
        code = job.finish(timeout=600)
        if code != 0:
            raise BenchError(f"mpirun failed (exit code {code}): {job.why()}")
        backend = next((r.data["backend"] for r in job.snapshot("backend")), "mpi4py")
        return backend, _bus([r.data for r in job.snapshot("allreduce")], RANKS)


class _MpiJob(LineJob):
    """``mpirun``: only rank 0 prints, plain JSON lines."""

    def split(self, line: str) -> tuple[str, str] | None:
        text = line.strip()
        return ("", text) if text.startswith("{") and text.endswith("}") else None


def loopback(ctx: Context) -> dict[str, Any]:
    """Bytes per second one process streams to another over 127.0.0.1 (median of repeats)."""
    total = ctx.pick(512 * MIB, 2048 * MIB)
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "tcp_loopback.py"), "--bytes", str(total), "--repeats", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(f"the loopback test failed: {done.stderr.strip()[-500:]}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    rates = [r["bytes"] / r["seconds"] for r in records]
    return {"bytes": total, "Bps": summarize(rates)}


def loopback_Bps(ctx: Context) -> float:
    """The loopback bound measured in this run (measured now if no item measured it yet)."""
    if "loopback" not in ctx.results:
        ctx.results["loopback"] = loopback(ctx)
    return float(ctx.results["loopback"]["Bps"]["median"])


def run(ctx: Context) -> dict[str, Any]:
    bound = loopback_Bps(ctx)
    series: dict[str, Any] = {"horovod_gloo": {"label": "Horovod/Gloo (elastic-run, default)"}}
    series["horovod_gloo"]["rows"] = horovod(ctx)
    winner = ctx.results.get("fusion_sweep", {}).get("winner")
    if winner:
        env = ctx.results["fusion_sweep"]["variants"][winner]["env"]
        series["horovod_gloo_tuned"] = {
            "label": f"Horovod/Gloo (elastic-run, {winner})",
            "env": env,
            "rows": horovod(ctx, env),
        }
    missing = mpi_available()
    if missing is None:
        for key, transports, what in (
            ("mpi", None, "Open MPI defaults"),
            ("mpi_tcp", "self,tcp", "Open MPI, TCP only"),
        ):
            try:
                backend, rows = mpi(ctx, transports)
            except BenchError as exc:
                log(f"MPI ({what}) failed: {exc}")
                series[key] = {"label": f"MPI ({what})", "error": str(exc), "rows": []}
                continue
            series[key] = {"label": f"MPI ({what})", "library": backend, "rows": rows}
    else:
        log(f"MPI skipped: {missing}")
    largest = {
        key: max((row["busbw_Bps"] for row in value["rows"]), default=None)
        for key, value in series.items()
    }
    return {
        "what": f"allreduce of float32, sum, {RANKS} ranks on this machine; "
        "busbw = algbw * 2(n-1)/n",
        "ranks": RANKS,
        "loopback_Bps": bound,
        "mpi_missing": missing,
        "series": series,
        "peak_busbw_Bps": largest,
        "peak_vs_loopback": {
            key: None if value is None else value / bound for key, value in largest.items()
        },
        "median_busbw_ratio_gloo_vs_mpi_tcp": _ratio(series, "horovod_gloo", "mpi_tcp"),
    }


def _ratio(series: dict[str, Any], a: str, b: str) -> float | None:
    """Median over message sizes of busbw(a) / busbw(b), sizes both measured."""
    if a not in series or b not in series:
        return None
    theirs = {row["bytes"]: row["busbw_Bps"] for row in series[b]["rows"]}
    ratios = [
        row["busbw_Bps"] / theirs[row["bytes"]]
        for row in series[a]["rows"]
        if row["bytes"] in theirs
    ]
    return statistics.median(ratios) if ratios else None
