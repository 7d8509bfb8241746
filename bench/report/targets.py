"""The Targets section: one row per target an item has (met, missed, skipped), and under the
table what limits each missed one, which A/B figures are within noise and which items were not
measured."""

from __future__ import annotations

from typing import Any

from bench.report import faults, multihost, observability, progress, state, stragglers, throughput
from bench.report.common import Check, fixed, met_text, table

#: What limits an item when it misses its target (shown only when it does).
LIMITS = {
    "throughput": (
        "The two launchers run the same script with the same Horovod settings; what differs is "
        "the rest of what each launcher runs beside the workers on the same cores (see the CPU "
        "table of item 1) and the noise of a shared machine (see the per-round ratios)."
    ),
    "crash": (
        "Recovery is bounded by the ring guard noticing the failure epoch in etcd, Horovod's "
        "reset (shutdown, rendezvous, Gloo re-init) and one step at the new size."
    ),
    "hang": (
        "A stopped process sends nothing and fails nothing: its agent sees it stopped (it looks "
        "at its processes' state every {check:g} s) and kills it once stopped for {limit:g} s "
        "(STOPPED_LIMIT in launcher/node/agent.py); from then on it is a crash, and the ring "
        "re-forms as after a SIGKILL (item 2: median {crash} s). So recovery is the agent's "
        "{limit:g} s stopped limit plus the re-form: a median <= 1 s needs a shorter limit."
    ),
    "scaleup": (
        'The rows "from ready" of item 4 show where the time goes: the survivors\' reset and the '
        "joiner's hvd.init() take a fraction of it; the rest is the joiner running the script's "
        "code after hvd.init() in a cold process (building the model, the state, the first "
        "tf.function trace), while every other rank waits for it in the state broadcast and "
        "the first allreduce: that wait is the pause the survivors see. This row is the cold "
        "joiner, the baseline: `--warm-join` moves that work before the joiner asks to join "
        "(the rows below it)."
    ),
    "commit": (
        "Batching the host-update votes removed most of the collective's share (item 5's stretch "
        "table); what is left is the in-memory copy of the state (one eager op per variable) and "
        "the hand-off of the snapshot, both competing for the machine's cores with the other "
        "rank and with the snapshot writers' background copies of the previous commit (on 2 "
        "cores the same commit takes about 3.4 ms back to back, 0.4 ms in one process without "
        "elastic-run's snapshots)."
    ),
    "straggler_detect": (
        "The watch names a rank once every member has filled its window of 10 progress reports "
        "(about one a second) since the quota: see item 11."
    ),
    "straggler_evict": (
        "After the eviction the ring runs at the replacement's pace; on a 2-core machine the "
        "new process also competes with the others for the cores while it starts: see item 11."
    ),
    "scaleup_warm_plain": (
        "With --warm-join the joiner's set-up happens before it is ready; what is left is the "
        "survivors' reset (shutdown and init of Horovod, the state broadcast) and the first "
        "steps in the new ring: see the rows of the table with --warm-join."
    ),
    "scaleup_warm_ea_state": (
        "With --warm-join the joiner's set-up happens before it is ready; what is left is the "
        "survivors' reset (shutdown and init of Horovod, the state broadcast) and the first "
        "steps in the new ring: see the rows of the table with --warm-join."
    ),
    "partition": (
        "A cut host sends nothing and fails nothing: it is noticed only when its leases in etcd "
        "expire, the lease TTL (--lease-ttl) after their last renewal (every TTL / 3), and then "
        "the ring re-forms as after a crash (the SIGKILL row of item 9). So a cut costs the TTL, "
        "less the time since the last renewal, plus that re-form: a faster recovery needs a "
        "shorter --lease-ttl."
    ),
    "progress": (
        "The reporting is an attribute write per step and, once a second, one small HTTP PUT "
        "from a daemon thread of each training process to the launcher; on a machine with few "
        "cores that thread and the launcher's handler run beside the workers. A difference "
        "smaller than the rounds' own spread (see the per-round figures) is noise of a shared "
        "machine rather than a cost of the reporting."
    ),
    "observability": (
        "What A adds: on rank 0, a step listener that buffers four scalars per step and a "
        "flush every few seconds on the training thread (every rank waits for it at the next "
        "allreduce); in the launcher, the dashboard server answering one scrape a second on "
        "the cores the workers use. A difference smaller than the rounds' own spread (see the "
        "per-round figures) is noise of a shared machine rather than a cost of the features; "
        "the costs timed directly say how large the cost is."
    ),
}


def _limit(key: str, items: dict[str, Any]) -> str:
    """What limits ``key`` when it misses its target (with this run's figures, where used)."""
    if key != "hang":
        return LIMITS[key]
    hang = items.get("faults", {}).get("hang", {})
    return LIMITS[key].format(
        check=hang.get("state_check_interval_s", 0.2),
        limit=hang.get("stopped_limit_s", 1.0),
        crash=fixed(hang.get("crash_median_s"), 2),
    )


def section(items: dict[str, Any]) -> list[str]:
    checks: list[Check] = []
    checks += throughput.check(items.get("throughput", {}))
    checks += faults.checks(items.get("faults", {}))
    checks += state.check(items.get("state", {}))
    progress_ = items.get("progress", {})
    checks += progress.check(progress_)
    checks += multihost.check(items.get("multihost", {}))
    checks += stragglers.checks(items.get("stragglers", {}))
    observability_ = items.get("observability", {})
    checks += observability.check(observability_)
    noisy = [
        (number, title, item)
        for number, title, item in (
            ("8", "progress reporting overhead", progress_),
            ("10", "observability overhead", observability_),
        )
        if "met" in item and item["noise_pct"] > item["target_overhead_pct"]
    ]
    lines = ["## Targets", ""]
    lines += table(
        ["item", "figure (elastic-run)", "target"], [[t, f, met_text(m)] for _, t, m, f in checks]
    )
    lines.append("")
    for key, title, met, _ in checks:
        if met is False:
            lines += [f"- **{title} misses its target.** {_limit(key, items)}"]
    for number, title, item in noisy:
        lines.append(
            f"- {number}. {title}: the rounds' own spread ({item['noise_pct']:.1f} %) exceeds "
            f"the {item['target_overhead_pct']:g} % target, so the figure is within noise (see "
            f"item {number}"
            + (", and the cost timed directly there)." if item.get("direct") else ").")
        )
    for name, item in items.items():
        if "error" in item or "skipped" in item:
            lines.append(
                f"- **{name} was not measured**: {item['error']}"
                if "error" in item
                else f"- {name} was skipped: {item['skipped']}"
            )
    lines.append("")
    return lines
