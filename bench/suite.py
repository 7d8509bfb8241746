"""The benchmark suite: elastic-run side by side with horovodrun (and MPI), in one run.

    python -m bench.suite [--quick] [--items a,b,...] [--merge] [--out DIR] [--markdown FILE]
    python -m bench.suite --render [--out DIR] [--markdown FILE]

Runs the items in order (each a module of bench/items/), then writes DIR/latest.json,
DIR/latest.png and the Markdown report (bench/RESULTS.md by default). With --merge, the items
measured replace theirs in the existing DIR/latest.json and the other items keep their figures
(measure one item again without losing the rest). Nothing is asserted: a target that is missed
is reported as missed. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.items import (  # noqa: E402
    collectives,
    faults,
    multihost,
    observability,
    progress,
    state,
    stragglers,
    throughput,
)
from bench.items.context import Context  # noqa: E402
from bench.jobs import log, own_temp_folder  # noqa: E402
from elastic_allreduce.store import EmbeddedEtcd  # noqa: E402

#: Item name -> what measures it, in the order they run (the sweep before the allreduce item,
#: which also measures the sweep's winner).
ITEMS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "throughput": throughput.run,
    "fusion_sweep": throughput.run_sweep,
    "faults": faults.run,
    "allreduce": collectives.run,
    "state": state.run,
    "progress": progress.run,
    "multihost": multihost.run,
    "observability": observability.run,
    "stragglers": stragglers.run,
}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _command_version(command: list[str], pattern: str) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(pattern, done.stdout + done.stderr)
    return match.group(1) if match else None


def machine_info() -> dict[str, Any]:
    cpu = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.MULTILINE)
    memory = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.MULTILINE)
    load = os.getloadavg()
    return {
        "cpu": cpu.group(1).strip() if cpu else platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "memory_gib": int(memory.group(1)) / 1024**2 if memory else 0.0,
        "system": f"{platform.system()} {platform.release()}, {platform.libc_ver()[1] or ''}",
        "load_average": " ".join(f"{v:.2f}" for v in load),
    }


def versions() -> dict[str, str]:
    found: dict[str, str] = {"python": platform.python_version()}
    for name in ("tensorflow-cpu", "horovod", "etcd3gw", "mpi4py", "matplotlib"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["Open MPI"] = _command_version(["mpirun", "--version"], r"Open MPI\)? ([\d.]+)") or (
        "not installed"
    )
    etcd = os.environ.get("ELASTIC_ALLREDUCE_ETCD_BIN") or "etcd"
    found["etcd"] = _command_version([etcd, "--version"], r"etcd Version: ([\d.]+)") or "?"
    commit = _command_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], r"(\w+)")
    dirty = _command_version(["git", "-C", str(ROOT), "status", "--porcelain"], r"(\S)")
    found["elastic-allreduce"] = f"{commit or '?'}{' (+ local changes)' if dirty else ''}"
    return found


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def merge(previous: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """``previous`` (a suite result) with the items of ``measured`` in place of its own.

    The result keeps ``previous``'s date, mode, machine and versions (the report's header, and
    the run of every item not measured again); each merged item brings its figures, its
    duration and its ``item_runs`` entry (when it ran, the load then, the commit, the mode).
    """
    merged: dict[str, Any] = json.loads(json.dumps(previous))  # a deep copy
    for key in ("items", "item_seconds", "item_runs"):
        merged.setdefault(key, {}).update(measured.get(key, {}))
    if "loopback" in measured:
        merged["loopback"] = measured["loopback"]
    return merged


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds every job's context manager: nothing is left running


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter trials (~5 min)")
    parser.add_argument(
        "--items", default=",".join(ITEMS), help=f"comma-separated, of: {', '.join(ITEMS)}"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other items of DIR/latest.json: the items measured now replace theirs",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--markdown", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: write the report and plot again from DIR/latest.json",
    )
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((args.out / "latest.json").read_text())
        written = report.write(results, args.out, args.markdown)
        log("wrote " + ", ".join(map(str, written)))
        return 0
    chosen = [name.strip() for name in args.items.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(ITEMS))
    if unknown:
        parser.error(f"unknown items {unknown}; choose from {list(ITEMS)}")
    signal.signal(signal.SIGTERM, _on_sigterm)

    started = time.monotonic()
    results: dict[str, Any] = {
        "schema": 1,
        "mode": "quick" if args.quick else "full",
        "started": _now(),
        "machine": machine_info(),
        "versions": versions(),
        "items": {},
        "item_seconds": {},
        # When each item started, the load then, and the code measured: a result merged from
        # several runs (one item measured again) still says which figure comes from when.
        "item_runs": {},
    }
    log(f"{results['mode']} run of {chosen} on {results['machine']}")
    with own_temp_folder(), EmbeddedEtcd() as etcd:
        ctx = Context(quick=args.quick, etcd=etcd)
        for name in (name for name in ITEMS if name in chosen):
            log(f"--- {name}")
            item_started = time.monotonic()
            results["item_runs"][name] = {
                "run": results["started"],
                "started": _now(),
                "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()),
                "commit": results["versions"]["elastic-allreduce"],
                "mode": results["mode"],
            }
            try:
                results["items"][name] = ITEMS[name](ctx)
            except Exception as exc:  # one item's failure must not lose the others
                traceback.print_exc()
                results["items"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            ctx.results[name] = results["items"][name]
            results["item_seconds"][name] = time.monotonic() - item_started
            log(f"--- {name} took {results['item_seconds'][name]:.0f} s")
    if "loopback" in ctx.results:
        results["loopback"] = ctx.results["loopback"]
    results["duration_s"] = time.monotonic() - started
    previous = args.out / "latest.json"
    if args.merge and previous.exists():
        results = merge(json.loads(previous.read_text()), results)
        log(f"merged {chosen} into {previous}")
    written = report.write(results, args.out, args.markdown)
    log(
        f"done in {(time.monotonic() - started) / 60:.1f} min; wrote "
        + ", ".join(map(str, written))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
