"""Item 10: the observability features' overhead on steady throughput (A/B rounds, the machine's
load beside them) and their costs timed directly."""

from __future__ import annotations

from typing import Any

from bench.report.common import (
    Check,
    ab_check,
    ab_noise,
    ab_per_cpu,
    ab_ratio,
    ab_rounds,
    rate_table,
    stat,
    table,
)


def section(item: dict[str, Any]) -> list[str]:
    cpu = item.get("cpu", {})
    scrapes = item.get("scrapes", {})
    lines = [
        "## 10. Observability overhead",
        "",
        ab_rounds(item) + f" A: observed (`{item['observed_flags']}`, and a thread of the suite "
        f"GETs `/metrics` every {item['scrape_interval_s']:g} s for the whole job, as Prometheus "
        "would); B: neither flag, nothing scraping. Both run `hvd_steps.py --summaries`: the "
        "script attaches rank 0's summaries (`elastic_allreduce.training.tensorboard`, as "
        "`ea.State` does; without a directory they add no step listener) and passes each "
        "step's global batch and loss to `report_step`.",
        "",
        *machine_load(item),
        *rate_table(
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
        *ab_ratio(item, "launcher with its dashboard server, agents, etcd"),
        *ab_per_cpu(item, "rank 0's summaries"),
    ]
    if scrapes.get("n"):
        lines += [
            f"What A's rounds saw: scrapes answered per round {stat(scrapes, '', 0)} "
            f"({item['scrape_failures']} failed); a scrape's wall time (median of each round) "
            f"{stat(item['scrape_wall_s'], ' s', 4)}; {item['metrics_bytes']:,.0f} bytes of "
            "metrics; rank 0's event file at the end of each window "
            f"{stat(item['event_bytes'], ' bytes', 0)}.",
            "",
        ]
    lines += _direct(item)
    lines += ab_noise(item, "; the costs timed directly bound it")
    return lines


def machine_load(item: dict[str, Any]) -> list[str]:
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


def _direct(item: dict[str, Any]) -> list[str]:
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
        *table(
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


def check(item: dict[str, Any]) -> list[Check]:
    """Item 10's row of the targets table (none when it did not run)."""
    title = "10. observability overhead"
    return ab_check(item, "observability", title, ("observed", "observed"), ("not_observed", "not"))
