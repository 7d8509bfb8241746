"""``python -m bench.soak``: the command line of `make soak`; runs the clean job and the soak
job on the same test hosts and etcd cluster, then writes the result, the Soak section of
bench/RESULTS.md and the log (everything it started removed, whatever happened)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import IO, Any

import bench.soak
from bench.jobs import ROOT
from bench.soak import faults, report
from bench.soak.figures import run_figures
from bench.soak.hosts import HostEtcd, inside
from bench.soak.job import SoakJob
from bench.soak.schedule import Plan, schedule
from bench.soak.settings import (
    END_LIMIT_S,
    EPOCHS_PER_FAULT,
    GLOBAL_BATCH,
    LEASE_TTL,
    MAX_NODES,
    MIN_EPOCHS,
    POOL,
    RESULTS_DIR,
    SCRIPT,
    SNAPSHOT_ROOT,
    WORKER_HOSTS,
    SoakError,
    say,
)
from bench.soak.summary import by_kind, machine, notes, verdict
from tests.helpers import testhosts
from tests.helpers.testhosts import TestHosts


def run_job(
    name: str,
    plans: Sequence[Plan],
    *,
    hosts: TestHosts,
    etcd: HostEtcd,
    workdir: Path,
    epochs: int,
    log: IO[str],
    samples: int,
    standby_in_outages: bool,
    nodes: int = POOL,
) -> dict[str, Any]:
    """One job from start to end (its processes gone after, whatever happened); its figures."""
    log.write(f"=== {name} run\n")
    say(f"{name} run: {epochs} epochs, {len(plans)} faults")
    job = SoakJob(
        name,
        hosts=hosts,
        etcd=etcd,
        workdir=workdir,
        epochs=epochs,
        log=log,
        standby_in_outages=standby_in_outages,
    )
    error, code = None, None
    try:
        job.start(nodes)
        faults.run_schedule(job, plans)
        code = job.finish(END_LIMIT_S)
        faults.settle_joins(job, final=True)
    except SoakError as exc:
        error = str(exc)
        say(f"{name} run FAILED: {error}")
    except Exception as exc:  # a bug here, or a fault that could not be made: still report
        error = f"{type(exc).__name__}: {exc}"
        log.write(traceback.format_exc())
        say(f"{name} run FAILED: {error}")
    finally:
        job.stop()
    figures = run_figures(job, code, error, samples)
    say(
        f"{name} run: exit {code}, accuracy {figures['accuracy']}, {figures['wall_s']:.0f} s, "
        f"goodput {figures.get('goodput')}, audit {figures['audit']}"
    )
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=(bench.soak.__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--seed", type=int, help="the schedule's seed (default: a new one)")
    parser.add_argument("--faults", type=int, default=100, help="faults in the schedule (100)")
    parser.add_argument(
        "--epochs", type=int, help=f"the job's epochs (default: {EPOCHS_PER_FAULT} per fault)"
    )
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    parser.add_argument(
        "--no-standby-in-outages",
        action="store_true",
        help="stop the standby launcher before each quorum loss and start it again after (by "
        "default it stays, and may take the job over as etcd returns with every lease expired)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json")
    parser.add_argument("--markdown", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--log", type=Path, default=RESULTS_DIR / "soak.log")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    epochs = args.epochs or max(MIN_EPOCHS, math.ceil(args.faults * EPOCHS_PER_FAULT))
    plans = schedule(seed, args.faults)
    reason = testhosts.available()
    if reason is not None:
        print(f"soak: test hosts cannot be made here: {reason}", file=sys.stderr)
        return 2
    replay = f"make soak SEED={seed}" + (f" FAULTS={args.faults}" if args.faults != 100 else "")
    say(f"seed {seed} ({replay}): {args.faults} faults, {epochs} epochs")

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]  # noqa: PLC0415

    samples = int(0.8 * len(load_digits().images))  # cnn_digits.py's training split
    started, began = datetime.now(UTC), time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="elastic-allreduce-soak-"))
    # What the killed processes leave in their temp folder (autograph files) goes with workdir.
    (workdir / "tmp").mkdir()
    os.environ["TMPDIR"] = str(workdir / "tmp")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    hosts = TestHosts(1 + WORKER_HOSTS)
    runs: dict[str, dict[str, Any] | None] = {"clean": None, "soak": None}
    try:
        with open(args.log, "w", buffering=1) as log:
            hosts.start()
            with inside(hosts[0]):
                etcd = HostEtcd(hosts[0].address(), workdir / "etcd")
                try:
                    etcd.start()
                    say(f"etcd cluster {etcd.endpoints_text} on {hosts[0].name}")
                    for name, schedule_ in (("clean", []), ("soak", plans)):
                        if name == "clean" and args.no_clean:
                            continue
                        runs[name] = run_job(
                            name,
                            schedule_,
                            hosts=hosts,
                            etcd=etcd,
                            workdir=workdir,
                            epochs=epochs,
                            log=log,
                            samples=samples,
                            standby_in_outages=not args.no_standby_in_outages,
                        )
                finally:
                    etcd.close()
    except KeyboardInterrupt as exc:
        say(f"interrupted ({exc or 'Ctrl-C'}): removing everything the soak started")
        return 130
    finally:
        try:
            hosts.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(SNAPSHOT_ROOT, ignore_errors=True)
    soak = runs["soak"]
    assert soak is not None
    clean = runs["clean"]
    delta = None
    if clean is not None and clean["accuracy"] is not None and soak["accuracy"] is not None:
        delta = round(100 * (soak["accuracy"] - clean["accuracy"]), 2)
    result: dict[str, Any] = {
        "schema": 1,
        "seed": seed,
        "replay": replay,
        "started": f"{started:%Y-%m-%d %H:%M} UTC",
        "duration_s": round(time.monotonic() - began, 1),
        "machine": machine(),
        "workload": {
            "script": str(SCRIPT.relative_to(ROOT)),
            "epochs": epochs,
            "global_batch": GLOBAL_BATCH,
            "samples": samples,
            "pool": POOL,
            "max_nodes": MAX_NODES,
            "worker_hosts": WORKER_HOSTS,
            "lease_ttl_s": LEASE_TTL,
        },
        "faults_planned": len(plans),
        "faults_injected": len(soak["faults"]),
        "kinds": by_kind(soak["faults"]),
        "soak": soak,
        "clean": clean,
        "accuracy_delta_points": delta,
    }
    result["notes"] = notes(not args.no_standby_in_outages)
    missed = verdict(result)
    result["missed"] = missed
    result["ok"] = not missed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    report.update(args.markdown, result)
    say(f"wrote {args.out} and the Soak section of {args.markdown}; the log: {args.log}")
    for line in missed:
        say(f"MISSED: {line}")
    say(f"{'passed' if not missed else 'FAILED'} in {result['duration_s'] / 60:.1f} min ({replay})")
    return 0 if not missed else 1
