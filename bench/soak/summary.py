"""The figures of the whole soak, over both runs: each fault kind's count and recovery, the
machine it ran on, and the verdict (what missed: empty when the soak passed) with the notes a
reader of the figures needs."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.jobs import ROOT, summarize
from bench.soak.settings import KINDS


def by_kind(faults: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: count, recovered, recovery summary, and each numeric detail's summary."""
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        details: dict[str, list[float]] = {}
        for fault in mine:
            for key, value in fault["detail"].items():
                if isinstance(value, float):
                    details.setdefault(key, []).append(value)
        kinds[kind] = {
            "count": len(mine),
            "recovered": sum(f["recovery_s"] is not None for f in mine),
            "recovery_s": summarize([f["recovery_s"] for f in mine]),
            "detail": {key: summarize(values) for key, values in details.items()},
            "modes": sorted({str(f["detail"]["mode"]) for f in mine if "mode" in f["detail"]}),
            # Ring epochs formed while the job recovered: for a fault that changes no ring
            # (a stall, launcher, etcd), a re-form going on already (a restarted rank joining).
            "with_reform": sum(bool(f["detail"].get("reforms")) for f in mine),
        }
    return kinds


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpu": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "commit": commit or "?",
    }


def verdict(result: dict[str, Any]) -> list[str]:
    """What missed: empty when the soak passed."""
    soak, clean = result["soak"], result["clean"]
    missed = list(soak["problems"])
    if soak["error"]:
        missed.append(f"soak run: {soak['error']}")
    if result["faults_injected"] < result["faults_planned"]:
        missed.append(f"{result['faults_injected']} of {result['faults_planned']} faults made")
    unrecovered = [
        f["index"]
        for f in soak["faults"]
        if f["recovery_s"] is None and not f["detail"].get("ended_first")
    ]
    if unrecovered:
        missed.append(f"faults without recovery: {unrecovered}")
    if not soak["succeeded"]:
        missed.append(f"the soak job did not succeed (exit {soak['exit_code']})")
    if not (soak["audit"]["ok"] and soak["audit"]["complete"]):
        missed.append(f"sample audit of the soak run: {soak['audit']}")
    if soak["state_lost"]:
        missed.append(f"state lost {soak['state_lost']} times")
    if clean is not None:
        if not clean["succeeded"] or clean["error"]:
            missed.append(f"the clean run failed: {clean['error'] or clean['exit_code']}")
        delta = result["accuracy_delta_points"]
        if delta is None or abs(delta) > 1.0:
            missed.append(f"accuracy differs from the clean run by {delta} points (> 1)")
    return missed


def notes(standby_in_outages: bool) -> list[str]:
    """What a reader of the figures must know about how they were made."""
    found = [
        "The sample audit cannot see a lost state: a ring that restarts from the initial state "
        "runs every epoch again under a higher ring epoch, and the audit keeps those runs; "
        "`state lost` counts the launcher's own verdicts.",
    ]
    if not standby_in_outages:
        found.insert(
            0,
            "Quorum losses are made without a standby launcher (`--no-standby-in-outages`: it "
            "is stopped before and started again after), so no takeover happens as etcd "
            "returns.",
        )
    return found
