"""The benchmark report writer: well-formed JSON, Markdown and PNG from a synthetic result.

Nothing here is measured and nothing is timed: the figures are made up to exercise the writer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import report
from bench.jobs import summarize
from bench.report import observability

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(scale: float) -> list[dict[str, Any]]:
    return [
        {
            "bytes": nbytes,
            "reps": 3,
            "time_per_op_s": nbytes / scale,
            "algbw_Bps": scale,
            "busbw_Bps": scale,
        }
        for nbytes in (4096, 1 << 20, 1 << 28)
    ]


def synthetic() -> dict[str, Any]:
    crash = summarize([0.2, 0.25, None])
    slow = summarize([30.1, 0.4])
    return {
        "schema": 1,
        "mode": "quick",
        "started": "2026-01-01 00:00 UTC",
        "duration_s": 60.0,
        "machine": {
            "cpu": "test CPU",
            "cores": 2,
            "memory_gib": 4.0,
            "system": "Linux",
            "load_average": "0.00 0.00 0.00",
        },
        "versions": {"python": "3.11", "horovod": "0.28.1"},
        "item_seconds": {},
        "items": {
            "throughput": {
                "what": "steps/s",
                "params": 1,
                "rounds": 2,
                "seconds_per_round": 1.0,
                "elastic_run": summarize([10.0, 11.0]),
                "horovodrun_static": summarize([10.5, 11.0]),
                "ratio": 0.98,
                "round_ratios": [0.95, 1.0],
                "cpu": {
                    name: summarize([0.5, 1.9])
                    for name in (
                        "elastic_run_workers",
                        "elastic_run_others",
                        "horovodrun_workers",
                        "horovodrun_others",
                    )
                },
                "target": 0.97,
                "met": True,
            },
            "fusion_sweep": {
                "what": "x",
                "rounds": 1,
                "seconds_per_round": 1.0,
                "default": summarize([10.0]),
                "variants": {
                    "cycle 0.1 ms": {
                        "env": {"HOROVOD_CYCLE_TIME": "0.1"},
                        "steps_per_s": summarize([11.0]),
                        "vs_default": 1.1,
                    }
                },
                "best": "cycle 0.1 ms",
                "winner": "cycle 0.1 ms",
                "winner_margin": 0.03,
            },
            "faults": {
                "params": 1,
                "faults": [],
                "crash": {
                    "what": "kill",
                    "elastic_run": crash,
                    "horovodrun_elastic": slow,
                    "horovodrun_elastic_gloo_timeout_5s": slow,
                    "target_s": 1.0,
                    "met": True,
                },
                "hang": {
                    "what": "stop",
                    "elastic_run": summarize([1.2, 1.3]),
                    "crash_median_s": 0.225,
                    "stopped_limit_s": 1.0,
                    "state_check_interval_s": 0.2,
                    "target_s": 1.0,
                    "target_stat": "median",
                    "met": False,
                },
                "scaleup": {
                    "what": "join",
                    "elastic_run": summarize([2.5]),
                    "from_registration": summarize([5.0]),
                    "pause": summarize([2.4]),
                    "step_interval": summarize([0.01]),
                    "target_s": 2.0,
                    "pause_target_s": 0.5,
                    "met": False,
                },
            },
            "allreduce": {
                "what": "allreduce",
                "ranks": 2,
                "loopback_Bps": 3e9,
                "mpi_missing": None,
                "series": {
                    "horovod_gloo": {"label": "Horovod", "rows": _rows(5e8)},
                    "mpi_tcp": {"label": "MPI TCP", "library": "test MPI", "rows": _rows(1e9)},
                },
                "peak_busbw_Bps": {"horovod_gloo": 5e8, "mpi_tcp": 1e9},
                "peak_vs_loopback": {"horovod_gloo": 0.17, "mpi_tcp": 0.33},
                "median_busbw_ratio_gloo_vs_mpi_tcp": 0.5,
            },
            "state": {
                "what": "state",
                "commit_every": 10,
                "loopback_Bps": 3e9,
                "models": [
                    {
                        "params": params,
                        "state_bytes": params * 12,
                        "step_s": params / 1e8,
                        "commit_s": 0.02,
                        "commit_parts_s": {"save": 0.001, "report": 0.005, "check": 0.01},
                        "commit_share": 0.05,
                        "sync_first_s": 0.5,
                        "sync_warm_s": None,
                        "sync_bound_s": params * 12 / 3e9,
                        "commit_snapshots_off_s": 0.0191,
                        "commit_snapshots_on_s": 0.0202,
                        "snapshot_write_s": params / 2e8,
                        "checkpoint_write_s": params / 1e8,
                        "restore_s": {
                            "snapshot": params / 4e8,
                            "checkpoint_cold": params / 5e7,
                            "checkpoint_warm": params / 3e8,
                        },
                        "store_rounds": 3,
                        "store_problems": [],
                    }
                    for params in (1_000_000, 50_000_000)
                ],
                "store_rounds": 3,
                "checkpoint_filesystem": "ext4 at /",
            },
            "progress": {
                "what": "steps/s, reporting on vs off",
                "params": 1,
                "rounds": 2,
                "seconds_per_round": 1.0,
                "reporting_on": summarize([9.9, 10.1]),
                "reporting_off": summarize([10.0, 10.2]),
                "on_env": {"ELASTIC_ALLREDUCE_PROGRESS_INTERVAL": "1"},
                "off_env": {"ELASTIC_ALLREDUCE_PROGRESS_INTERVAL": "0"},
                "ratio": 0.99,
                "round_ratios": [0.99, 0.99],
                "overhead_pct": 0.98,
                "round_overheads_pct": [0.98, 0.98],
                "noise_pct": 2.0,
                "steps_per_cpu_s": {"on": 9.0, "off": 9.1},
                "per_cpu_overhead_pct": 1.1,
                "direct": {
                    "report_step_cpu_s": 2e-7,
                    "report_cpu_s": 3e-4,
                    "cpu_per_process_s_per_s": 3.02e-4,
                    "process_cpu_s_per_s": 0.75,
                    "overhead_pct": 0.0403,
                },
                "cpu": {
                    name: summarize([0.5, 1.9])
                    for name in ("on_workers", "on_others", "off_workers", "off_others")
                },
                "target_overhead_pct": 1.0,
                "met": True,
            },
        },
    }


def _multihost() -> dict[str, Any]:
    """Item 9's result: a cut link next to a SIGKILL on test hosts, and the throughput ratio."""
    cut = summarize([3.4, 4.6])
    return {
        "params": 100_000,
        "hosts": "1 launcher host + 3 worker hosts joined bare, one training process each",
        "lease_ttl_s": 3,
        "faults": [
            {"kind": "kill", "host": "h2", "recovery_s": 0.3, "fenced_s": None, "back_s": 9.0},
            {"kind": "cut", "host": "h3", "recovery_s": 3.4, "fenced_s": 3.1, "back_s": 12.0},
            {"kind": "kill", "error": "BenchError: timed out"},
        ],
        "partition": {
            "what": "link of rank 1's host cut -> every survivor completed a step at size 2 (s)",
            "elastic_run": cut,
            "crash": summarize([0.3]),
            "fenced": summarize([3.1]),
            "rejoin": summarize([12.0]),
            "crash_back": summarize([9.0]),
            "floor_s": 3,
            "target_s": 4.0,
            "met": False,
        },
        "throughput": {
            "what": "steps/s of rank 0 at 3 ranks, ~100,000 parameters, same script",
            "rounds": 2,
            "seconds_per_round": 5.0,
            "test_hosts": summarize([40.0, 44.0]),
            "loopback": summarize([50.0, None]),
            "ratio": 0.84,
            "round_ratios": [0.8],
            "cpu": {
                name: summarize([1.5, 1.7])
                for name in (
                    "test_hosts_workers",
                    "test_hosts_others",
                    "loopback_workers",
                    "loopback_others",
                )
            },
        },
    }


def _check_tables(text: str) -> None:
    """Every table row has as many cells as its header."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("|") and index + 1 < len(lines) and lines[index + 1].startswith("| ---"):
            cells = line.count("|")
            row = index + 2
            while row < len(lines) and lines[row].startswith("|"):
                assert lines[row].count("|") == cells, lines[row]
                row += 1


def test_report_files_are_well_formed(tmp_path: Path) -> None:
    results = synthetic()
    markdown = tmp_path / "RESULTS.md"
    written = report.write(results, tmp_path / "results", markdown)

    assert {p.name for p in written} == {"latest.json", "latest.png", "RESULTS.md"}
    assert json.loads((tmp_path / "results" / "latest.json").read_text()) == results
    assert (tmp_path / "results" / "latest.png").read_bytes().startswith(PNG_MAGIC)

    text = markdown.read_text()
    assert text.startswith("# Benchmark results\n")
    assert "![main figures](results/latest.png)" in text
    for heading in ("## Targets", "## 1. Steady-state throughput", "## 7. Allreduce"):
        assert heading in text
    # A missed target says so, with what limits it.
    assert "**4. scale-up misses its target.**" in text
    assert "0.980" in text and "cycle 0.1 ms" in text
    assert "## 5 and 6. Commit cost and state sync" in text
    assert "## 8. Progress reporting overhead" in text
    assert "**1.0 %** (target <= 1 %: met)" in text
    assert "| 8. progress reporting overhead | 1.0 % (on 10.00 vs off 10.10 steps/s; timed" in text
    assert "A 9.0, B 9.1, overhead 1.1 %" in text
    assert "one `report_step` call 0.20 µs of CPU, one report as the beacon sends it" in text
    assert "**0.04 %** of the CPU one uses with the reporting off (0.75 cores)" in text
    assert "timed directly: 0.04 % of a process's CPU" in text
    # A spread larger than the target is said to be noise.
    assert "the rounds' own spread (2.0 %) exceeds the 1 % target" in text
    _check_tables(text)


def test_a_missed_hang_target_says_why_next_to_the_sigkill_figure() -> None:
    text = report.render_markdown(synthetic(), png_link=None)
    assert "Target: stopped -> survivors step again, median <= 1 s" in text
    assert "| elastic-run, SIGKILL of the same job (item 2) | 0.225 s" in text
    assert "SIGKILL: median 0.225 s" in text
    assert "**3. hang recovery misses its target.**" in text
    assert "kills it once stopped for 1 s (STOPPED_LIMIT in launcher/node/agent.py)" in text
    assert "(item 2: median 0.23 s)" in text
    _check_tables(text)


def test_items_measured_in_other_runs_are_dated() -> None:
    results = synthetic()
    results["item_runs"] = {
        name: {"run": results["started"], "started": f"2026-01-01 00:0{i} UTC"}
        for i, name in enumerate(results["items"])
    }
    assert "items measured" not in report.render_markdown(results, png_link=None)
    for name, started in (("faults", "10:00"), ("progress", "10:05")):
        results["item_runs"][name] = {
            "run": "2026-02-01 10:00 UTC",
            "started": f"2026-02-01 {started} UTC",
            "load_average": "1.50 1.00 1.00",
            "commit": "abc1234",
        }
    text = report.render_markdown(results, png_link=None)
    row = next(line for line in text.splitlines() if line.startswith("| items measured (UTC) |"))
    assert "throughput (00:00, " not in row  # no load was recorded for it
    assert "throughput (00:00)" in row and ": run of 2026-01-01 00:00 UTC" in row
    assert (
        "faults (10:00, load 1.50), progress (10:05, load 1.50): run of 2026-02-01 10:00 UTC, "
        "abc1234" in row
    )
    _check_tables(text)


def test_an_item_that_failed_is_reported_as_not_measured() -> None:
    results = synthetic()
    results["items"]["state"] = {"error": "BenchError: the state job failed"}
    text = report.render_markdown(results, png_link=None)
    assert "state was not measured" in text
    assert "Not measured in this run: BenchError: the state job failed" in text
    assert "![main figures]" not in text
    _check_tables(text)


def _state_section(text: str) -> str:
    return text[text.index("## 5 and 6.") : text.index("## 7. Allreduce")]


def test_snapshot_checkpoint_and_restore_costs_are_shown_per_model() -> None:
    results = synthetic()
    section = _state_section(report.render_markdown(results, png_link=None))
    assert (
        "| parameters | commit ms, snapshot off | commit ms, snapshot on | snapshot write ms "
        "(background) | checkpoint write ms | restore ms: snapshot | restore ms: checkpoint "
        "cold / warm | restore ms: broadcast fresh / warm |" in section
    )
    # commit off / on, snapshot write, checkpoint write, restore: snapshot, checkpoint cold /
    # warm, broadcast (the sync) fresh / warm; each in ms.
    assert "| 1,000,000 | 19.1 | 20.2 | 5.0 | 10.0 | 2.5 | 20.0 / 3.3 | 500.0 / — |" in section
    assert (
        "| 50,000,000 | 19.1 | 20.2 | 250.0 | 500.0 | 125.0 | 1000.0 / 166.7 | 500.0 / — |"
        in section
    )
    assert "medians of 3 rounds per model" in section
    assert "to a folder on ext4 at /." in section
    assert "room in /dev/shm for two copies of the state per rank" in section
    _check_tables(section)

    # A figure that could not be taken says why.
    model = results["items"]["state"]["models"][0]
    model["snapshot_write_s"] = None
    model["store_problems"] = ["the snapshot of commit 7 was not written"]
    section = _state_section(report.render_markdown(results, png_link=None))
    assert "| 1,000,000 | 19.1 | 20.2 | — | 10.0 |" in section
    assert "- 1,000,000 parameters: the snapshot of commit 7 was not written" in section


def test_state_results_from_before_the_snapshot_figures_still_render(tmp_path: Path) -> None:
    results = synthetic()
    for model in results["items"]["state"]["models"]:
        for key in (
            "commit_snapshots_off_s",
            "commit_snapshots_on_s",
            "snapshot_write_s",
            "checkpoint_write_s",
            "restore_s",
            "store_rounds",
            "store_problems",
        ):
            del model[key]
    section = _state_section(report.render_markdown(results, png_link=None))
    assert "| 1,000,000 | 11.4 MiB |" in section
    assert "snapshot write" not in section
    report.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_MAGIC)


def test_summarize_counts_failed_trials() -> None:
    summary = summarize([2.0, None, 1.0, 3.0])
    assert summary["n"] == 3
    assert summary["failed"] == 1
    assert (summary["median"], summary["min"], summary["max"]) == (2.0, 1.0, 3.0)
    assert summarize([None])["n"] == 0


def test_partition_recovery_is_shown_next_to_the_sigkill_on_test_hosts(tmp_path: Path) -> None:
    results = synthetic()
    results["items"]["multihost"] = _multihost()
    text = report.render_markdown(results, png_link=None)
    assert "## 9. Partition recovery and throughput on test hosts" in text
    section = text[text.index("## 9. Partition") :]
    assert (
        "| link cut -> every survivor completed a step at size 2 | 4.000 s (3.400-4.600), n=2 |"
        in section
    )
    assert "| SIGKILL of the same rank -> the same (same job, same hosts) | 0.300 s" in section
    assert "The expected floor of a cut is the lease TTL (3 s, the `--lease-ttl` option)" in section
    assert "max <= lease TTL + 1 s = 4 s: **missed**" in section
    assert "- Trial failed (later trials not run): kill: BenchError: timed out" in section
    assert "| test hosts (veth + bridge) | 42.00 (40.00-44.00), n=2 |" in section
    assert "| loopback | 50.00 (50.00-50.00), n=1, 1 failed |" in section
    assert "2 alternating round(s) of 5 s" in section
    assert "test hosts / loopback: **0.840**; per round: 0.800." in section
    assert (
        "CPU-second of the training processes (median over rounds): test hosts 26.3, "
        "loopback 33.3, ratio 0.788." in section
    )
    # The targets table has its row, and a missed bound says what limits it.
    assert (
        "| 9. partition recovery (test hosts) | 4.000 s (3.400-4.600), n=2 (target: max <= "
        "lease TTL + 1 s = 4 s); SIGKILL: median 0.300 s; steps/s test hosts / loopback 0.840 "
        "| **missed** |" in text
    )
    assert "**9. partition recovery (test hosts) misses its target.** A cut host" in text
    _check_tables(text)
    # The plot takes it too.
    report.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG_MAGIC)


def test_multihost_skipped_without_test_hosts_says_why() -> None:
    results = synthetic()
    reason = "test hosts cannot be made here: network namespaces need root (uid 1000)"
    results["items"]["multihost"] = {"skipped": reason}
    text = report.render_markdown(results, png_link=None)
    assert f"Skipped: {reason}." in text
    assert "| 9. partition recovery (test hosts) | skipped | — |" in text
    assert f"- multihost was skipped: {reason}" in text
    assert "partition recovery (test hosts) misses" not in text
    _check_tables(text)


def test_the_soak_section_outlives_a_bench_run(tmp_path: Path) -> None:
    """`make bench` writes RESULTS.md anew; the Soak section, from `make soak`'s own result in
    the same folder, stays (once)."""
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    recorded = Path(report.__file__).parent.parent / "results" / "soak.json"
    (results_dir / "soak.json").write_text(recorded.read_text())
    markdown = tmp_path / "RESULTS.md"
    for _ in range(2):
        report.write(synthetic(), results_dir, markdown)
    text = markdown.read_text()
    assert text.count("\n## Soak\n") == 1, text
    seed = json.loads(recorded.read_text())["seed"]
    assert str(seed) in text.split("\n## Soak\n", 1)[1]


def test_the_observability_rounds_are_called_noisy_only_for_other_work() -> None:
    """The load after the rounds includes their own jobs: only the one before them says that
    other work ran beside them."""
    quiet = observability.machine_load({"load_average": {"start": 0.99, "end": 3.5}, "cores": 2})
    busy = observability.machine_load({"load_average": {"start": 7.65, "end": 12.7}, "cores": 2})
    assert "busier" not in quiet[0] and "3.50 after them (their own jobs included)." in quiet[0]
    assert "other work kept the machine busier than its 2 cores" in busy[0]


def test_the_warm_join_scale_up_is_shown_next_to_the_cold_joiner_it_is_measured_against() -> None:
    results = synthetic()
    warm = {
        "elastic_run": summarize([0.45, 0.5]),
        "from_registration": summarize([6.0]),
        "pause": summarize([0.4, 0.45]),
        "step_interval": summarize([0.01]),
        "survivors_reset": summarize([0.3]),
        "joiner_first_step": summarize([0.45, 0.5]),
        "met": True,
    }
    slow_pause = {**warm, "pause": summarize([0.7]), "met": False}
    results["items"]["faults"]["scaleup_warm"] = {
        "what": "warm",
        "plain": slow_pause,
        "ea_state": warm,
        "target_s": 2.0,
        "pause_target_s": 0.5,
        "met": False,
    }
    text = report.render_markdown(results, png_link=None)
    assert "| what | plain Horovod script + warm_up | ea.State script |" in text
    assert "| pause of the existing ranks (longest gap between two steps) | 0.700 s" in text
    assert "(cold joiner) | **missed** |" in text
    assert "(--warm-join, ea.State script) | met |" in text
    assert "(--warm-join, plain Horovod script + warm_up) | **missed** |" in text
    assert "Targets with --warm-join: scale-up <= 2 s and pause <= 0.5 s: **missed**." in text
    _check_tables(text)
    # Results from before the warm join render as before.
    assert "warm_up" not in report.render_markdown(synthetic(), png_link=None)


def test_the_commit_cost_with_batched_votes_is_a_target_next_to_votes_at_every_commit() -> None:
    results = synthetic()
    state = results["items"]["state"]
    smallest = state["models"][0]
    smallest["commit_mean_s"] = {"every_commit": 0.008, "batched": 0.003}
    smallest["commit_mean_share"] = {"every_commit": 0.04, "batched": 0.015}
    state["commit_target_share"] = 0.02
    state["commit_met"] = True
    text = report.render_markdown(results, png_link=None)
    assert "| parameters | votes at every commit | votes batched |" in text
    assert "| 1,000,000 | 8.0 (4.0%) | 3.0 (1.5%) |" in text
    assert "| 5. commit cost | 1.5% of the commit interval at 1,000,000 parameters" in text
    assert "batched: met." in text
    _check_tables(text)
    state["commit_met"] = False
    assert "**5. commit cost misses its target.**" in report.render_markdown(results, png_link=None)
    # Results from before the votes were batched have neither the table nor the target row.
    assert "votes batched" not in report.render_markdown(synthetic(), png_link=None)


def test_the_straggler_item_shows_each_launcher_and_both_targets() -> None:
    results = synthetic()
    results["items"]["stragglers"] = {
        "what": "rank 1 of 3 held to 15 % of a CPU",
        "percent": 15,
        "seconds": 15.0,
        "report": {"clean_per_s": 60.0, "detect_s": 12.5, "after_per_s": 25.0, "message": "m"},
        "evict": {"clean_per_s": 61.0, "detect_s": 33.0, "after_per_s": 58.0, "message": "m"},
        "horovodrun_static": {"clean": 62.0, "slowed": 24.0},
        "evict_ratio": 58.0 / 61.0,
        "detect_target_s": 30.0,
        "evict_tolerance": 0.1,
        "detect_met": False,
        "evict_met": True,
    }
    text = report.render_markdown(results, png_link=None)
    assert "--straggler-policy evict | 61.0 | 58.0 (its node replaced) | 33.0 |" in text
    assert "| horovodrun, static | 62.0 | 24.0 (nothing notices) | — |" in text
    assert "| 33.0 s at most (report and evict jobs) vs <= 30 s | **missed**" in text
    assert "| 11. straggler evicted | steps/s after the eviction 0.951 of the clean job's" in text
    assert "**11. straggler named misses its target.**" in text
    _check_tables(text)
    results["items"]["stragglers"] = {"skipped": "no cgroup"}
    assert "Skipped: no cgroup." in report.render_markdown(results, png_link=None)
