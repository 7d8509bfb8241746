"""Item 9: partition recovery and throughput on test hosts (network namespaces) against
loopback."""

from __future__ import annotations

from typing import Any

from bench.report.common import Check, fixed, met_text, rate_table, stat, steps_per_cpu, table


def section(item: dict[str, Any]) -> list[str]:
    title = "## 9. Partition recovery and throughput on test hosts"
    if "skipped" in item:
        return [title, "", f"Skipped: {item['skipped']}.", ""]
    part, rate = item["partition"], item["throughput"]
    ttl = item["lease_ttl_s"]
    failed = [f"{f['kind']}: {f['error']}" for f in item.get("faults", []) if "error" in f]
    ratio = rate.get("ratio")
    per_round = ", ".join(f"{r:.3f}" for r in rate.get("round_ratios", []))
    cpu = rate.get("cpu", {})
    return [
        title,
        "",
        f"Test hosts: network namespaces on one bridge (tests/helpers/testhosts.py), "
        f"{item['hosts']}; ~{item['params']:,} parameters (bench/scripts/hvd_steps.py), "
        f"`--lease-ttl {ttl}`. In one job, faults on the host of rank 1 of 3, alternating: "
        "SIGKILL of its training process, and its link cut (the bridge side of its veth down: "
        "a pulled cable). After a cut the link comes back once the cut host has stopped its "
        "training process, and the next fault waits until the host is back in the ring.",
        "",
        *table(
            ["what", "seconds: median (min-max)"],
            [
                [
                    "link cut -> every survivor completed a step at size 2",
                    stat(part["elastic_run"]),
                ],
                [
                    "SIGKILL of the same rank -> the same (same job, same hosts)",
                    stat(part["crash"]),
                ],
                [
                    "link cut -> the cut host's agent stops its training process (fenced)",
                    stat(part["fenced"]),
                ],
                ["link back -> the host's new rank stepping at size 3", stat(part["rejoin"])],
                ["SIGKILL -> the restarted rank stepping at size 3", stat(part["crash_back"])],
            ],
        ),
        "",
        f"The expected floor of a cut is the lease TTL ({part['floor_s']:g} s, the `--lease-ttl` "
        "option): a cut host sends nothing and fails nothing, so it is noticed only when its "
        "leases expire, the TTL after their last renewal (they are renewed every TTL / 3, so "
        "between 2/3 of the TTL and the TTL after the cut); a SIGKILL is noticed at once (its "
        "agent sees the process exit). Bound (the issue's): cut -> survivors step again, max "
        f"<= lease TTL + 1 s = {part['target_s']:g} s: {met_text(part['met'])}.",
        "",
        *([f"- Trial failed (later trials not run): {text}" for text in failed]),
        *([""] if failed else []),
        f"Steady throughput, {rate['what']}: test hosts vs loopback (`elastic-run run "
        f"--workers 3`), {rate['rounds']} alternating round(s) of {rate['seconds_per_round']:g} s "
        "(the order swaps every round), a fresh job per round; the first test-hosts job then "
        "runs the faults above.",
        "",
        *rate_table(
            "network",
            [
                (
                    "test hosts (veth + bridge)",
                    rate["test_hosts"],
                    cpu.get("test_hosts_workers"),
                    cpu.get("test_hosts_others"),
                ),
                (
                    "loopback",
                    rate["loopback"],
                    cpu.get("loopback_workers"),
                    cpu.get("loopback_others"),
                ),
            ],
        ),
        "",
        f"Ratio of medians test hosts / loopback: **{fixed(ratio)}**"
        + (f"; per round: {per_round}" if per_round else "")
        + ". CPU in cores during the measured windows (the rest: launcher, its etcd, agents).",
        "",
        *_per_cpu_lines(rate),
    ]


def _per_cpu_lines(rate: dict[str, Any]) -> list[str]:
    """Steps per CPU-second of the training processes on each side (less sensitive to what
    else the machine runs than steps/s)."""
    if not rate.get("cpu"):
        return []
    hosts = steps_per_cpu(rate, "test_hosts", "test_hosts_workers")
    loopback = steps_per_cpu(rate, "loopback", "loopback_workers")
    if not hosts or not loopback:
        return []
    return [
        f"Steps per CPU-second of the training processes (median over rounds): test hosts "
        f"{hosts:.1f}, loopback {loopback:.1f}, ratio {hosts / loopback:.3f}.",
        "",
    ]


def check(item: dict[str, Any]) -> list[Check]:
    """Item 9's row of the targets table (none when it did not run or failed)."""
    title = "9. partition recovery (test hosts)"
    if "skipped" in item:
        return [("partition", title, None, "skipped")]
    if "partition" not in item:
        return []
    part, ratio = item["partition"], item["throughput"].get("ratio")
    figure = (
        f"{stat(part['elastic_run'])} (target: max <= lease TTL + 1 s = "
        f"{part['target_s']:g} s); SIGKILL: median {fixed(part['crash'].get('median'))} s; "
        f"steps/s test hosts / loopback {fixed(ratio)}"
    )
    return [("partition", title, part["met"], figure)]
