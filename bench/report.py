"""Turn a suite result (bench/results/latest.json) into bench/RESULTS.md and a PNG plot.

Pure functions of the result dict: nothing here measures, so the test suite can feed them a
synthetic result (tests/test_bench_report.py).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from bench import soak_report

MiB = 1024 * 1024

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
        crash=_s(hang.get("crash_median_s"), 2),
    )


def _s(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.1f}"


def _mbps(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:,.0f}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def _stat(summary: dict[str, Any] | None, unit: str = " s", digits: int = 3) -> str:
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


def _met(flag: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "—"}[flag]


def _rate_table(what: str, rows: list[tuple[str, Any, Any, Any]]) -> list[str]:
    """An A/B throughput table: steps/s, the training processes' CPU and the rest's, per side."""
    return _table(
        [what, "steps/s: median (min-max)", "CPU of the training processes", "the rest"],
        [
            [name, _stat(rate, "", 2), _stat(workers, "", 2), _stat(others, "", 3)]
            for name, rate, workers, others in rows
        ],
    )


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _error_section(title: str, item: dict[str, Any]) -> list[str]:
    return [f"## {title}", "", f"Not measured in this run: {item['error']}", ""]


def _throughput(item: dict[str, Any]) -> list[str]:
    ratios = ", ".join(f"{r:.3f}" for r in item.get("round_ratios", []))
    return [
        "## 1. Steady-state throughput",
        "",
        f"{item['what']}; {item['rounds']} alternating A/B rounds of "
        f"{item['seconds_per_round']:g} s each, a fresh job per round.",
        "",
        *_table(
            ["launcher", "steps/s: median (min-max)"],
            [
                ["elastic-run", _stat(item["elastic_run"], "", 2)],
                ["horovodrun --gloo (static)", _stat(item["horovodrun_static"], "", 2)],
            ],
        ),
        "",
        f"Ratio of medians elastic-run / horovodrun: **{item['ratio']:.3f}** (target >= "
        f"{item['target']}: {_met(item['met'])}); per round: {ratios}.",
        "",
        *_cpu(item),
    ]


def _per_cpu(item: dict[str, Any], launcher: str, workers: str) -> float | None:
    """Median over rounds of steps/s divided by the cores the training processes got."""
    steps = item[launcher]["values"]
    cores = item["cpu"][workers]["values"]
    ratios = [s / c for s, c in zip(steps, cores, strict=False) if s and c]
    return statistics.median(ratios) if ratios else None


def _cpu(item: dict[str, Any]) -> list[str]:
    cpu = item.get("cpu")
    if not cpu:
        return []
    ours = _per_cpu(item, "elastic_run", "elastic_run_workers")
    theirs = _per_cpu(item, "horovodrun_static", "horovodrun_workers")
    efficiency = (
        [
            f"Steps per CPU-second of the training processes (median over rounds; less "
            f"sensitive to what else the machine runs): elastic-run {ours:.1f}, horovodrun "
            f"{theirs:.1f}, ratio {ours / theirs:.3f}.",
            "",
        ]
        if ours and theirs
        else []
    )
    return [
        "CPU used during the measured windows, in cores: the training processes, and the rest "
        "of what the launcher runs (elastic-run: launcher, agents, etcd; horovodrun: its driver "
        "and task services).",
        "",
        *_table(
            ["launcher", "training processes", "the rest"],
            [
                [
                    "elastic-run",
                    _stat(cpu["elastic_run_workers"], "", 2),
                    _stat(cpu["elastic_run_others"], "", 3),
                ],
                [
                    "horovodrun --gloo (static)",
                    _stat(cpu["horovodrun_workers"], "", 2),
                    _stat(cpu["horovodrun_others"], "", 3),
                ],
            ],
        ),
        "",
        *efficiency,
    ]


def _sweep(item: dict[str, Any]) -> list[str]:
    rows = [["Horovod defaults", "", _stat(item["default"], "", 2), "1.000", ""]]
    for name, variant in item["variants"].items():
        env = " ".join(f"{k}={v}" for k, v in variant["env"].items())
        per_round = ", ".join(f"{r:.3f}" for r in variant.get("vs_default_per_round", []))
        rows.append(
            [
                name,
                f"`{env}`",
                _stat(variant["steps_per_s"], "", 2),
                f"{variant['vs_default']:.3f}",
                per_round,
            ]
        )
    verdict = (
        f"**{item['winner']}** beats the defaults in every round by more than "
        f"{item['winner_margin']:.1%} (the noise margin) in this run: a candidate for the default"
        + (", to be confirmed by a full run." if item["rounds"] < 2 else ".")
        if item.get("winner")
        else f"No setting beats the defaults in every round by more than "
        f"{item['winner_margin']:.1%} (the noise margin: 3 % or the defaults' own "
        "round-to-round spread): keep Horovod's defaults."
    )
    return [
        "### Fusion threshold / cycle time sweep (elastic-run, same workload)",
        "",
        f"{item['rounds']} round(s) of {item['seconds_per_round']:g} s per setting"
        + (
            "; the defaults are item 1's elastic-run rounds."
            if item.get("default_from_throughput_item")
            else ", alternating with the defaults (each round starts at another setting)."
        ),
        "",
        *_table(["setting", "environment", "steps/s", "vs defaults", "per round"], rows),
        "",
        verdict,
        "",
    ]


def _faults(item: dict[str, Any]) -> list[str]:
    crash, hang, scaleup = item["crash"], item["hang"], item["scaleup"]
    lines = [
        "## 2. Crash recovery (SIGKILL)",
        "",
        f"{crash['what']}; ~{item['params']:,} parameters. elastic-run: trials in one job of 3 "
        "workers (the killed slot is restarted between trials); horovodrun: elastic mode with a "
        "discovery script and distinct host aliases, a fresh job per trial.",
        "",
        *_table(
            ["launcher", "seconds: median (min-max)"],
            [
                ["elastic-run", _stat(crash["elastic_run"])],
                ["horovodrun elastic, default Gloo timeout", _stat(crash["horovodrun_elastic"])],
                [
                    "horovodrun elastic, HOROVOD_GLOO_TIMEOUT_SECONDS=5",
                    _stat(crash["horovodrun_elastic_gloo_timeout_5s"]),
                ],
            ],
        ),
        "",
        f"Target for elastic-run: max <= {crash['target_s']:g} s: {_met(crash['met'])}.",
        "",
        "## 3. Hang recovery (SIGSTOP)",
        "",
        f"{hang['what']}.",
        "",
        *_table(
            ["launcher", "seconds: median (min-max)"],
            [
                ["elastic-run, SIGSTOP", _stat(hang["elastic_run"])],
                ["elastic-run, SIGKILL of the same job (item 2)", _stat(crash["elastic_run"])],
            ],
        ),
        "",
        _hang_target(hang),
        "",
        "## 4. Scale-up",
        "",
        f"{scaleup['what']}. The new worker is the restarted process of each fault above.",
        "",
        *_table(
            ["what", "seconds: median (min-max)"],
            [
                ["ready -> all ranks stepping at the new size", _stat(scaleup["elastic_run"])],
                [
                    "registration (before its cold TensorFlow import) -> all stepping",
                    _stat(scaleup["from_registration"]),
                ],
                [
                    "pause of the existing ranks (longest gap between two steps)",
                    _stat(scaleup["pause"]),
                ],
                ["their normal step interval at size 2", _stat(scaleup["step_interval"], " s", 4)],
                *(
                    [f"from ready: {what}", _stat(scaleup[key])]
                    for key, what in (
                        ("survivors_reset", "survivors re-initialised (reset callback)"),
                        ("joiner_init", "joiner's hvd.init() returned"),
                        ("joiner_first_step", "joiner's first step (model built, step traced)"),
                    )
                    if key in scaleup
                ),
            ],
        ),
        "",
        f"Targets: scale-up <= {scaleup['target_s']:g} s and pause <= "
        f"{scaleup['pause_target_s']:g} s: {_met(scaleup['met'])}.",
        "",
        *_warm_scaleup(item.get("scaleup_warm")),
    ]
    return lines


#: The jobs of item 4 with --warm-join, as the report names them.
WARM_JOBS: Final = (("plain", "plain Horovod script + warm_up"), ("ea_state", "ea.State script"))


def _warm_scaleup(warm: dict[str, Any] | None) -> list[str]:
    """Item 4 with --warm-join, next to the cold joiner above (none for older results)."""
    if not warm:
        return []
    parts = [(warm[key], name) for key, name in WARM_JOBS if key in warm]
    rows = [
        [what, *(_stat(part.get(key)) for part, _ in parts)]
        for key, what in (
            ("elastic_run", "ready -> all ranks stepping at the new size"),
            ("from_registration", "registration -> all stepping (includes the warm-up)"),
            ("pause", "pause of the existing ranks (longest gap between two steps)"),
            ("survivors_reset", "from ready: survivors re-initialised"),
            ("joiner_first_step", "from ready: joiner's first step in the ring"),
        )
    ]
    return [
        "With `--warm-join`, in two more jobs of the same kind (SIGKILLs only): "
        f"{warm['what']}. The restarted process builds its model and traces its step at a ring "
        "of one before it asks to join; the others train on meanwhile.",
        "",
        *_table(["what", *(name for _, name in parts)], rows),
        "",
        f"Targets with --warm-join: scale-up <= {warm['target_s']:g} s and pause <= "
        f"{warm['pause_target_s']:g} s: {_met(warm['met'])}.",
        "",
    ]


def _hang_target(hang: dict[str, Any]) -> str:
    """Item 3's target line (results before the agent's stopped limit: max <= lease TTL + 1 s)."""
    if hang.get("target_stat") != "median":
        return f"Target: max <= lease TTL + 1 s = {hang['target_s']:g} s: {_met(hang['met'])}."
    limit = hang.get("stopped_limit_s")
    why = (
        f" (the agent kills a process stopped for {limit:g} s, then the ring re-forms as after "
        "a SIGKILL)"
        if limit is not None
        else ""
    )
    return (
        f"Target: stopped -> survivors step again, median <= {hang['target_s']:g} s"
        f"{why}: {_met(hang['met'])}."
    )


def _progress(item: dict[str, Any]) -> list[str]:
    per_round = ", ".join(f"{r:.3f}" for r in item.get("round_ratios", []))
    overheads = ", ".join(f"{o:+.1f} %" for o in item.get("round_overheads_pct", []))
    cpu = item.get("cpu", {})
    off_env = " ".join(f"{k}={v}" for k, v in item.get("off_env", {}).items())
    return [
        "## 8. Progress reporting overhead",
        "",
        f"{item['what']}; {item['rounds']} alternating A/B rounds of "
        f"{item['seconds_per_round']:g} s each (the order swaps every round), a fresh job per "
        "round. A: reporting on (the default beacon interval, and the script calls "
        "`elastic_allreduce.progress.report_step(step)` after every step); B: reporting off "
        f"(`{off_env}`: no beacon thread, no per-step call).",
        "",
        *_rate_table(
            "reporting",
            [
                ("A: on", item["reporting_on"], cpu.get("on_workers"), cpu.get("on_others")),
                ("B: off", item["reporting_off"], cpu.get("off_workers"), cpu.get("off_others")),
            ],
        ),
        "",
        f"Ratio of medians A / B: {item['ratio']:.3f}, overhead (1 - A/B) = "
        f"**{item['overhead_pct']:.1f} %** (target <= {item['target_overhead_pct']:g} %: "
        f"{_met(item['met'])}); per round A / B: {per_round} (overhead {overheads}); the "
        f"rounds' own spread: {item['noise_pct']:.1f} %. CPU in cores during the measured "
        "windows (the rest: launcher with its rendezvous server, agents, etcd).",
        "",
        *_progress_per_cpu(item),
        *_progress_direct(item),
        *_progress_noise(item),
    ]


def _progress_direct(item: dict[str, Any]) -> list[str]:
    direct = item.get("direct")
    if not direct or direct.get("overhead_pct") is None:
        return []
    return [
        "Timed directly in the suite's process (upper bounds, loop overhead included): one "
        f"`report_step` call {direct['report_step_cpu_s'] * 1e6:.2f} µs of CPU, one report as "
        f"the beacon sends it (build, PUT to a local server answering like the launcher, "
        f"decode the reply) {direct['report_cpu_s'] * 1e3:.2f} ms. At A's step rate and one "
        f"report a second that is {direct['cpu_per_process_s_per_s'] * 1e3:.2f} ms of CPU per "
        f"second per training process, **{direct['overhead_pct']:.2f} %** of the CPU one uses "
        f"with the reporting off ({direct['process_cpu_s_per_s']:.2f} cores).",
        "",
    ]


def _progress_per_cpu(item: dict[str, Any]) -> list[str]:
    per_cpu = item.get("steps_per_cpu_s", {})
    if item.get("per_cpu_overhead_pct") is None:
        return []
    return [
        f"Steps per CPU-second of the training processes, their beacon thread included (median "
        f"over rounds; less sensitive to what else the machine runs): A {per_cpu['on']:.1f}, "
        f"B {per_cpu['off']:.1f}, overhead {item['per_cpu_overhead_pct']:.1f} %.",
        "",
    ]


def _progress_noise(item: dict[str, Any]) -> list[str]:
    """A caveat when the rounds' own spread is larger than the target."""
    if item["noise_pct"] <= item["target_overhead_pct"]:
        return []
    return [
        f"The rounds' own spread ({item['noise_pct']:.1f} %) is larger than the target "
        f"({item['target_overhead_pct']:g} %): in this run the A/B figure cannot tell an "
        "overhead of that size from noise.",
        "",
    ]


def _observability(item: dict[str, Any]) -> list[str]:
    per_round = ", ".join(f"{r:.3f}" for r in item.get("round_ratios", []))
    overheads = ", ".join(f"{o:+.1f} %" for o in item.get("round_overheads_pct", []))
    cpu = item.get("cpu", {})
    scrapes = item.get("scrapes", {})
    per_cpu = item.get("steps_per_cpu_s", {})
    lines = [
        "## 10. Observability overhead",
        "",
        f"{item['what']}; {item['rounds']} alternating A/B rounds of "
        f"{item['seconds_per_round']:g} s each (the order swaps every round), a fresh job per "
        f"round. A: observed (`{item['observed_flags']}`, and a thread of the suite GETs "
        f"`/metrics` every {item['scrape_interval_s']:g} s for the whole job, as Prometheus "
        "would); B: neither flag, nothing scraping. Both run `hvd_steps.py --summaries`: the "
        "script attaches rank 0's summaries (`elastic_allreduce.training.tensorboard`, as "
        "`ea.State` does; without a directory they add no step listener) and passes each "
        "step's global batch and loss to `report_step`.",
        "",
        *_observability_load(item),
        *_rate_table(
            "observability",
            [
                ("A: observed", item["observed"], cpu.get("on_workers"), cpu.get("on_others")),
                (
                    "B: not observed",
                    item["not_observed"],
                    cpu.get("off_workers"),
                    cpu.get("off_others"),
                ),
            ],
        ),
        "",
        f"Ratio of medians A / B: {item['ratio']:.3f}, overhead (1 - A/B) = "
        f"**{item['overhead_pct']:.1f} %** (target <= {item['target_overhead_pct']:g} %: "
        f"{_met(item['met'])}); per round A / B: {per_round} (overhead {overheads}); the "
        f"rounds' own spread: {item['noise_pct']:.1f} %. CPU in cores during the measured "
        "windows (the rest: launcher with its dashboard server, agents, etcd).",
        "",
    ]
    if item.get("per_cpu_overhead_pct") is not None:
        lines += [
            f"Steps per CPU-second of the training processes, rank 0's summaries included "
            f"(median over rounds; less sensitive to what else the machine runs): A "
            f"{per_cpu['on']:.1f}, B {per_cpu['off']:.1f}, overhead "
            f"{item['per_cpu_overhead_pct']:.1f} %.",
            "",
        ]
    if scrapes.get("n"):
        lines += [
            f"What A's rounds saw: scrapes answered per round {_stat(scrapes, '', 0)} "
            f"({item['scrape_failures']} failed); a scrape's wall time (median of each round) "
            f"{_stat(item['scrape_wall_s'], ' s', 4)}; {item['metrics_bytes']:,.0f} bytes of "
            "metrics; rank 0's event file at the end of each window "
            f"{_stat(item['event_bytes'], ' bytes', 0)}.",
            "",
        ]
    lines += _observability_direct(item)
    if item["noise_pct"] > item["target_overhead_pct"]:
        lines += [
            f"The rounds' own spread ({item['noise_pct']:.1f} %) is larger than the target "
            f"({item['target_overhead_pct']:g} %): in this run the A/B figure cannot tell an "
            "overhead of that size from noise; the costs timed directly bound it.",
            "",
        ]
    return lines


def _observability_load(item: dict[str, Any]) -> list[str]:
    """Where the rounds ran and how busy the machine was (others' work makes A/B noisy)."""
    load, cores = item.get("load_average"), item.get("cores")
    if not load or not cores:
        return []
    # Only the load before the rounds is other work's: the one after includes the rounds' jobs.
    busy = load["start"] > cores
    return [
        f"Ran on this machine ({cores} cores) with a 1-minute load average of "
        f"{load['start']:.2f} before the rounds and {load['end']:.2f} after them (their own "
        "jobs included)"
        + (
            f": other work kept the machine busier than its {cores} cores, so steps/s moved "
            "from round to round with that work, not only with A or B."
            if busy
            else "."
        ),
        "",
    ]


def _observability_direct(item: dict[str, Any]) -> list[str]:
    direct = item.get("direct")
    if not direct or direct.get("overhead_pct") is None:
        return []
    return [
        "Timed directly (upper bounds, loop overhead included): in a process of its own "
        f"(bench/scripts/summaries_cost.py), rank 0's step listener "
        f"{direct['on_step_cpu_s'] * 1e6:.1f} µs of CPU per step as the workload calls it (four "
        "scalars buffered; the loss tensor and the optimizer's learning-rate variable read), "
        f"{direct.get('on_step_floats_cpu_s', 0.0) * 1e6:.2f} µs when every metric is a Python "
        "float (Keras' logs with `lr`: no tensor read); one flush of "
        f"{direct['flush_seconds']:g} s of points at A's step rate "
        f"({direct['points_per_flush']:,.0f} points, {direct['bytes_per_point']:.0f} bytes each "
        f"in the event file) {direct['flush_cpu_s'] * 1e3:.2f} ms of CPU "
        f"({direct['flush_wall_s'] * 1e3:.2f} ms of wall time); rank 0's first marker, which "
        "creates the file and traces the write function, "
        f"{direct['first_write_cpu_s'] * 1e3:.0f} ms once. In the suite's process, against a "
        "launcher's dashboard server holding the metrics of a 2-rank job: one `/metrics` render "
        f"{direct['render_cpu_s'] * 1e6:.0f} µs ({direct['render_bytes']:,.0f} bytes), one whole "
        f"scrape (server and client) {direct['scrape_cpu_s'] * 1e3:.2f} ms.",
        "",
        *_table(
            ["per second of a steady job", "CPU ms", "share of a training process's CPU"],
            [
                [
                    f"rank 0: listener at {direct['steps_per_s']:.1f} steps/s + a flush every "
                    f"{direct['flush_seconds']:g} s",
                    f"{direct['rank0_cpu_s_per_s'] * 1e3:.2f}",
                    f"{direct['rank0_pct']:.2f} %",
                ],
                [
                    f"launcher: one scrape every {direct['scrape_interval_s']:g} s",
                    f"{direct['launcher_cpu_s_per_s'] * 1e3:.2f}",
                    f"{direct['launcher_pct']:.2f} %",
                ],
                [
                    "both",
                    f"{(direct['rank0_cpu_s_per_s'] + direct['launcher_cpu_s_per_s']) * 1e3:.2f}",
                    f"**{direct['overhead_pct']:.2f} %**",
                ],
            ],
        ),
        "",
        f"A training process uses {direct['process_cpu_s_per_s']:.2f} cores with the features "
        f"off (B). Rank 0's flush pauses its training thread for "
        f"{direct['flush_wall_s'] * 1e3:.1f} ms every {direct['flush_seconds']:g} s "
        f"({direct['flush_pause_pct']:.2f} % of its time), and the other rank waits for it at "
        "the next allreduce.",
        "",
    ]


def _state(item: dict[str, Any]) -> list[str]:
    rows = []
    for model in item["models"]:
        rows.append(
            [
                f"{model['params']:,}",
                _size(model["state_bytes"]),
                _ms(model["step_s"]),
                _ms(model["commit_s"]),
                " / ".join(_ms(model.get("commit_parts_s", {}).get(k)) for k in COMMIT_PARTS),
                f"{model['commit_share']:.1%}",
                _s(model["sync_first_s"]),
                _s(model["sync_warm_s"]),
                _s(model["sync_bound_s"]),
            ]
        )
    return [
        "## 5 and 6. Commit cost and state sync",
        "",
        f"{item['what']}; a commit every {item['commit_every']} steps. Share = commit / (commit + "
        f"{item['commit_every']} steps). Sync = State.sync() on rank 0 after a barrier; bound = "
        f"state bytes / loopback bandwidth ({_mbps(item['loopback_Bps'])} MiB/s, this run). "
        "Parts of a commit, each timed alone after a barrier: the in-memory save, rank 0's "
        "progress report to etcd, the host-update check (a broadcast among the ranks).",
        "",
        *_table(
            [
                "parameters",
                "state (weights + Adam slots)",
                "step ms",
                "commit ms",
                "parts ms: save / report / check",
                "commit share",
                "sync s (fresh ring)",
                "sync s (warm)",
                "bound S/B s",
            ],
            rows,
        ),
        "",
        *_commit_means(item),
        *_state_stores(item),
    ]


def _commit_means(item: dict[str, Any]) -> list[str]:
    """Item 5's commit cost over a stretch of commits, votes at every commit vs batched (none
    for results measured before the votes were batched)."""
    models = [model for model in item["models"] if model.get("commit_mean_s")]
    if not models:
        return []
    rows = [
        [
            f"{model['params']:,}",
            *(
                f"{_ms(model['commit_mean_s'][k])} ({model['commit_mean_share'][k]:.1%})"
                for k in ("every_commit", "batched")
            ),
        ]
        for model in models
    ]
    target = item.get("commit_target_share", 0.02)
    return [
        "The commit as training sees it: the mean over a stretch of commits, each timed where the "
        "loop commits (a host-update vote's wait for the slower rank included), with the votes "
        "at every commit (as before they were batched) and batched (the default: about every "
        "0.5 s, `ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL`); ms (share of a commit interval).",
        "",
        *_table(["parameters", "votes at every commit", "votes batched"], rows),
        "",
        f"Target: <= {target:.0%} of the commit interval at ~1 M parameters, batched: "
        f"{_met(item.get('commit_met'))}.",
        "",
    ]


COMMIT_PARTS = ("save", "report", "check")
#: Where a commit is loaded back from: restore_s's keys, as the table shows them.
RESTORES = ("snapshot", "checkpoint_cold", "checkpoint_warm")


def _state_stores(item: dict[str, Any]) -> list[str]:
    """Item 5's second table: the commit kept outside the process (a shared-memory snapshot, a
    checkpoint on disk) and loaded back, next to the peer broadcast; none for results measured
    before these figures were."""
    models = [model for model in item["models"] if "restore_s" in model]
    if not models:
        return []
    rows = []
    problems = []
    for model in models:
        restore = model["restore_s"]
        rows.append(
            [
                f"{model['params']:,}",
                _ms(model["commit_snapshots_off_s"]),
                _ms(model["commit_snapshots_on_s"]),
                _ms(model["snapshot_write_s"]),
                _ms(model["checkpoint_write_s"]),
                _ms(restore.get("snapshot")),
                " / ".join(_ms(restore.get(k)) for k in RESTORES[1:]),
                " / ".join(_ms(model[k]) for k in ("sync_first_s", "sync_warm_s")),
            ]
        )
        problems += [f"- {model['params']:,} parameters: {p}" for p in model["store_problems"]]
    rounds = item.get("store_rounds")
    return [
        "Keeping the commit outside the process, and loading it back (ms; medians of "
        f"{rounds if rounds is not None else 'a few'} rounds per model, each part after a "
        "barrier). Commit: `State.commit()` with the slot's shared-memory snapshot off (the "
        "State's writer detached) and on (the writer idle at the start): the snapshot's cost on "
        "the critical path. Snapshot write: from the commit's hand-off to the writer thread "
        "until it is written (in the background; every rank writes its own at once). "
        "Checkpoint write: `CheckpointDir.write` of the committed state, rank 0 alone, fsynced, "
        f"to a folder on {item.get('checkpoint_filesystem', 'disk')}. Restore: rank 0 alone "
        "loads the commit into the model (`state_snapshots.load_newest` with one source: read, "
        "checked, assigned, committed in memory) from the snapshot, and from the checkpoint "
        "with its files dropped from the page cache first (cold; a virtual machine's host may "
        "still cache its disk) and again (warm); the peer broadcast is the sync above at 2 "
        "ranks. The snapshot needs room in /dev/shm for two copies of the state per rank "
        "while a new one replaces the last.",
        "",
        *_table(
            [
                "parameters",
                "commit ms, snapshot off",
                "commit ms, snapshot on",
                "snapshot write ms (background)",
                "checkpoint write ms",
                "restore ms: snapshot",
                "restore ms: checkpoint cold / warm",
                "restore ms: broadcast fresh / warm",
            ],
            rows,
        ),
        "",
        *([*problems, ""] if problems else []),
    ]


def _collectives(item: dict[str, Any]) -> list[str]:
    series = item["series"]
    keys = list(series)
    sizes = sorted({row["bytes"] for value in series.values() for row in value["rows"]})
    rows = []
    for nbytes in sizes:
        row = [_size(nbytes)]
        for key in keys:
            found = [r for r in series[key]["rows"] if r["bytes"] == nbytes]
            row.append(_mbps(found[0]["busbw_Bps"]) if found else "—")
        rows.append(row)
    lines = [
        "## 7. Allreduce bus bandwidth",
        "",
        f"{item['what']}. MiB/s of bus bandwidth; loopback TCP bound measured in this run: "
        f"**{_mbps(item['loopback_Bps'])} MiB/s** (one process streaming to another).",
        "",
        *_table(["message", *(series[k]["label"] for k in keys)], rows),
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


def _multihost(item: dict[str, Any]) -> list[str]:
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
        *_table(
            ["what", "seconds: median (min-max)"],
            [
                [
                    "link cut -> every survivor completed a step at size 2",
                    _stat(part["elastic_run"]),
                ],
                [
                    "SIGKILL of the same rank -> the same (same job, same hosts)",
                    _stat(part["crash"]),
                ],
                [
                    "link cut -> the cut host's agent stops its training process (fenced)",
                    _stat(part["fenced"]),
                ],
                ["link back -> the host's new rank stepping at size 3", _stat(part["rejoin"])],
                ["SIGKILL -> the restarted rank stepping at size 3", _stat(part["crash_back"])],
            ],
        ),
        "",
        f"The expected floor of a cut is the lease TTL ({part['floor_s']:g} s, the `--lease-ttl` "
        "option): a cut host sends nothing and fails nothing, so it is noticed only when its "
        "leases expire, the TTL after their last renewal (they are renewed every TTL / 3, so "
        "between 2/3 of the TTL and the TTL after the cut); a SIGKILL is noticed at once (its "
        "agent sees the process exit). Bound (the issue's): cut -> survivors step again, max "
        f"<= lease TTL + 1 s = {part['target_s']:g} s: {_met(part['met'])}.",
        "",
        *([f"- Trial failed (later trials not run): {text}" for text in failed]),
        *([""] if failed else []),
        f"Steady throughput, {rate['what']}: test hosts vs loopback (`elastic-run run "
        f"--workers 3`), {rate['rounds']} alternating round(s) of {rate['seconds_per_round']:g} s "
        "(the order swaps every round), a fresh job per round; the first test-hosts job then "
        "runs the faults above.",
        "",
        *_rate_table(
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
        f"Ratio of medians test hosts / loopback: **{_s(ratio)}**"
        + (f"; per round: {per_round}" if per_round else "")
        + ". CPU in cores during the measured windows (the rest: launcher, its etcd, agents).",
        "",
        *_multihost_per_cpu(rate),
    ]


def _multihost_per_cpu(rate: dict[str, Any]) -> list[str]:
    """Steps per CPU-second of the training processes on each side (less sensitive to what
    else the machine runs than steps/s)."""
    if not rate.get("cpu"):
        return []
    hosts = _per_cpu(rate, "test_hosts", "test_hosts_workers")
    loopback = _per_cpu(rate, "loopback", "loopback_workers")
    if not hosts or not loopback:
        return []
    return [
        f"Steps per CPU-second of the training processes (median over rounds): test hosts "
        f"{hosts:.1f}, loopback {loopback:.1f}, ratio {hosts / loopback:.3f}.",
        "",
    ]


def _multihost_check(item: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
    """Item 9's row of the targets table (none when it did not run or failed)."""
    title = "9. partition recovery (test hosts)"
    if "skipped" in item:
        return [("partition", title, None, "skipped")]
    if "partition" not in item:
        return []
    part, ratio = item["partition"], item["throughput"].get("ratio")
    figure = (
        f"{_stat(part['elastic_run'])} (target: max <= lease TTL + 1 s = "
        f"{part['target_s']:g} s); SIGKILL: median {_s(part['crash'].get('median'))} s; "
        f"steps/s test hosts / loopback {_s(ratio)}"
    )
    return [("partition", title, part["met"], figure)]


def _stragglers(item: dict[str, Any]) -> list[str]:
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
        *_table(
            ["launcher", "steps/s, all at full speed", "steps/s, rank 1 slowed", "named after s"],
            rows,
        ),
        "",
        f"Targets: named within {item['detect_target_s']:g} s: {_met(item['detect_met'])}; with "
        f"evict, steps/s within {item['evict_tolerance']:.0%} of the clean figure "
        f"({_s(ratio)} of it): {_met(item['evict_met'])}.",
        "",
    ]


def _straggler_checks(item: dict[str, Any]) -> list[tuple[str, str, bool | None, str]]:
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
            f"steps/s after the eviction {_s(item.get('evict_ratio'))} of the clean job's vs >= "
            f"{1 - item['evict_tolerance']:.2f}",
        ),
    ]


def _scaleup_checks(
    title: str, cold: dict[str, Any], warm: dict[str, Any] | None
) -> list[tuple[str, str, bool, str]]:
    """Item 4's rows of the targets: the cold joiner, and with --warm-join (when measured) the
    rows that the target is for, the cold one being their baseline."""
    figure = f"{_stat(cold['elastic_run'])}; pause {_stat(cold['pause'])}"
    if not warm:
        return [("scaleup", title, cold["met"], figure)]
    checks = [("scaleup", title, cold["met"], figure + " (cold joiner)")]
    for name, label in WARM_JOBS:
        if name in warm:
            part = warm[name]
            figure = (
                f"{_stat(part['elastic_run'])}; pause {_stat(part['pause'])} (--warm-join, {label})"
            )
            checks.append((f"scaleup_warm_{name}", title, part["met"], figure))
    return checks


def _commit_check(state: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    """Item 5's row of the targets: the batched commit's share at ~1 M parameters."""
    if state.get("commit_met") is None:
        return []
    smallest = state["models"][0]
    shares = smallest["commit_mean_share"]
    figure = (
        f"{shares['batched']:.1%} of the commit interval at {smallest['params']:,} parameters "
        f"(votes at every commit: {shares['every_commit']:.1%}) vs <= "
        f"{state['commit_target_share']:.0%}"
    )
    return [("commit", "5. commit cost", state["commit_met"], figure)]


def _misses(items: dict[str, Any]) -> list[str]:
    checks = []
    throughput = items.get("throughput", {})
    if "met" in throughput:
        checks.append(
            (
                "throughput",
                "1. throughput ratio",
                throughput["met"],
                f"{throughput['ratio']:.3f} vs >= 0.97",
            )
        )
    faults = items.get("faults", {})
    for key, title in (
        ("crash", "2. crash recovery"),
        ("hang", "3. hang recovery"),
        ("scaleup", "4. scale-up"),
    ):
        if key in faults:
            part = faults[key]
            figure = _stat(part["elastic_run"])
            if key == "scaleup":
                checks += _scaleup_checks(title, part, faults.get("scaleup_warm"))
                continue
            if key == "hang" and part.get("target_stat") == "median":
                figure += (
                    f" (target: median <= {part['target_s']:g} s); SIGKILL: median "
                    f"{_s(part.get('crash_median_s'))} s"
                )
            checks.append((key, title, part["met"], figure))
    checks += _commit_check(items.get("state", {}))
    progress = items.get("progress", {})
    if "met" in progress:
        on = _s(progress["reporting_on"].get("median"), 2)
        off = _s(progress["reporting_off"].get("median"), 2)
        direct = progress.get("direct", {}).get("overhead_pct")
        timed = f"; timed directly: {direct:.2f} % of a process's CPU" if direct is not None else ""
        figure = (
            f"{progress['overhead_pct']:.1f} % (on {on} vs off {off} steps/s{timed}) vs <= "
            f"{progress['target_overhead_pct']:g} %"
        )
        checks.append(("progress", "8. progress reporting overhead", progress["met"], figure))
    checks += _multihost_check(items.get("multihost", {}))
    checks += _straggler_checks(items.get("stragglers", {}))
    observability = items.get("observability", {})
    if "met" in observability:
        on = _s(observability["observed"].get("median"), 2)
        off = _s(observability["not_observed"].get("median"), 2)
        direct = observability.get("direct", {}).get("overhead_pct")
        timed = f"; timed directly: {direct:.2f} % of a process's CPU" if direct is not None else ""
        figure = (
            f"{observability['overhead_pct']:.1f} % (observed {on} vs not {off} steps/s{timed}) "
            f"vs <= {observability['target_overhead_pct']:g} %"
        )
        checks.append(("observability", "10. observability overhead", observability["met"], figure))
    noisy = [
        (number, title, item)
        for number, title, item in (
            ("8", "progress reporting overhead", progress),
            ("10", "observability overhead", observability),
        )
        if "met" in item and item["noise_pct"] > item["target_overhead_pct"]
    ]
    lines = ["## Targets", ""]
    lines += _table(
        ["item", "figure (elastic-run)", "target"], [[t, f, _met(m)] for _, t, m, f in checks]
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


SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]]]] = {
    "throughput": ("1. Steady-state throughput", _throughput),
    "fusion_sweep": ("Fusion / cycle sweep", _sweep),
    "faults": ("2-4. Recovery and scale-up", _faults),
    "state": ("5 and 6. Commit cost and state sync", _state),
    "allreduce": ("7. Allreduce bus bandwidth", _collectives),
    "progress": ("8. Progress reporting overhead", _progress),
    "multihost": ("9. Partition recovery and throughput on test hosts", _multihost),
    "observability": ("10. Observability overhead", _observability),
    "stragglers": ("11. A straggler: report, evict, static horovodrun", _stragglers),
}


#: The order of the versions table (the suite's; latest.json stores its keys sorted).
VERSION_ORDER = (
    "python",
    "tensorflow-cpu",
    "horovod",
    "etcd3gw",
    "mpi4py",
    "matplotlib",
    "Open MPI",
    "etcd",
    "elastic-allreduce",
)


def _version_rank(name: str) -> tuple[int, str]:
    return (VERSION_ORDER.index(name) if name in VERSION_ORDER else len(VERSION_ORDER), name)


def _item_dates(results: dict[str, Any]) -> list[list[str]]:
    """A row saying which items come from which run, when a result merges several runs.

    ``item_runs`` (item -> ``run``: the ``started`` of the run that measured it, ``started``:
    when the item started, ``load_average`` then, ``commit``, ``mode``: shown when it is not
    the result's) is written by the suite (``--merge`` keeps several runs' items); an item
    without one was measured in the run of the result's own ``started``.
    """
    runs = results.get("item_runs", {})
    groups: dict[str, list[str]] = {}
    commits: dict[str, str] = {results["started"]: results["versions"].get("elastic-allreduce")}
    for name in results["items"]:
        run = runs.get(name, {})
        source = run.get("run", results["started"])
        started, load, mode = run.get("started"), run.get("load_average"), run.get("mode")
        details = [
            text
            for text in (
                started.split(" ")[1] if started and " " in started else None,
                f"load {load.split()[0]}" if load else None,
                f"{mode} mode" if mode and mode != results["mode"] else None,
            )
            if text
        ]
        groups.setdefault(source, []).append(name + (f" ({', '.join(details)})" if details else ""))
        if run.get("commit"):
            commits.setdefault(source, run["commit"])
    if len(groups) <= 1:
        return []
    parts = []
    for source, names in sorted(groups.items()):
        commit = f", {commits[source]}" if commits.get(source) else ""
        parts.append(f"{', '.join(names)}: run of {source}{commit}")
    return [["items measured (UTC)", "; ".join(parts)]]


def render_markdown(results: dict[str, Any], png_link: str | None = "results/latest.png") -> str:
    """RESULTS.md for one suite result."""
    machine, versions = results["machine"], results["versions"]
    items = results["items"]
    lines = [
        "# Benchmark results",
        "",
        "Generated by `make bench` (bench/suite.py) from bench/results/latest.json: do not edit by "
        "hand. Every comparison is taken in one run on one machine; figures from a busy machine "
        "are noisy.",
        "",
        *_table(
            ["", ""],
            [
                ["date (UTC)", results["started"]],
                *_item_dates(results),
                ["mode", f"{results['mode']} ({results['duration_s'] / 60:.1f} min)"],
                [
                    "machine",
                    f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']:.0f} GiB",
                ],
                ["system", machine["system"]],
                ["load average at start", machine.get("load_average", "—")],
                *[[name, versions[name]] for name in sorted(versions, key=_version_rank)],
            ],
        ),
        "",
    ]
    if png_link:
        lines += [f"![main figures]({png_link})", ""]
    lines += _misses(items)
    for key, (title, render) in SECTIONS.items():
        if key not in items:
            continue
        item = items[key]
        lines += _error_section(title, item) if "error" in item else render(item)
    return "\n".join(lines).rstrip() + "\n"


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
    progress = items.get("progress", {})
    if "reporting_on" in progress:
        on, off = progress["reporting_on"]["values"], progress["reporting_off"]["values"]
        ax.plot(range(1, len(on) + 1), on, "^--", label="elastic-run, progress reporting on")
        ax.plot(range(1, len(off) + 1), off, "v--", label="elastic-run, progress reporting off")
        title = f"8. progress reporting overhead {progress['overhead_pct']:.1f} %"
        ax.set_title("\n".join(t for t in (ax.get_title(), title) if t), fontsize=9)
    observability = items.get("observability", {})
    if "observed" in observability:
        on, off = observability["observed"]["values"], observability["not_observed"]["values"]
        ax.plot(range(1, len(on) + 1), on, "D:", label="elastic-run, observed")
        ax.plot(range(1, len(off) + 1), off, "d:", label="elastic-run, not observed")
        title = f"10. observability overhead {observability['overhead_pct']:.1f} %"
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


def write(results: dict[str, Any], results_dir: Path, markdown: Path) -> list[Path]:
    """Write latest.json, latest.png (when matplotlib is there) and the Markdown; their paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path = results_dir / "latest.json"
    json_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    png_path = results_dir / "latest.png"
    try:
        plot(results, png_path)
        link: str | None = os.path.relpath(png_path, markdown.resolve().parent)
    except ImportError:
        link = None
    markdown.write_text(render_markdown(results, link))
    soak = results_dir / "soak.json"
    if soak.is_file():
        # The soak's section comes from its own run (`make soak`), kept through this one.
        soak_report.update(markdown, json.loads(soak.read_text()))
    return [json_path, markdown, *([png_path] if link else [])]
