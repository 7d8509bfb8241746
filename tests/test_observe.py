"""The launcher's observation pieces without a job: events, metrics values, the timeline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.records.values import EpochCause, JobSettings
from launcher.observe.events import EventKind, JobEvent, read_events
from launcher.observe.metrics import JobMetrics
from launcher.observe.observer import add_observer_flags, observer_settings
from launcher.observe.timeline import build, render_file
from launcher.vocabulary import ChangeKind, MembershipChange

SETTINGS = JobSettings(1, 4, 1, 3)


def samples(metrics: JobMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by name and labels (as Prometheus would read it)."""
    text = metrics.exposition().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def reformed(epoch: int, cause: EpochCause, took: float, *slots: str) -> JobEvent:
    change = MembershipChange(ChangeKind.REFORMED, epoch, slots, "m", cause, took)
    return JobEvent.of_change(change, 100.0 + epoch)


def test_events_round_trip_and_bad_lines_are_skipped_with_a_reason() -> None:
    events = [
        reformed(1, EpochCause.START, 0.01, "n0.0", "n1.0"),
        JobEvent(101.5, EventKind.CRASHED, 1, "slot n1.0 crashed", ("n1.0",)),
        JobEvent(102.0, EventKind.PROGRESS, 1, step=40, size=2),
        JobEvent(103.0, EventKind.FINISHED, 2, "done", succeeded=True),
    ]
    lines = [json.dumps(e.to_json()) for e in events]
    lines[2:2] = ["not json", '{"at": "noon", "kind": "Joined", "epoch": 1}', "", "[1]"]
    read, skipped = read_events(lines)
    assert read == events
    assert [s.split(":")[0] for s in skipped] == ["line 3", "line 4", "line 6"]
    assert "'at' must be a number" in skipped[1]


def test_metrics_count_membership_changes_recoveries_and_reform_times() -> None:
    metrics = JobMetrics("job-1", SETTINGS)
    assert samples(metrics)[("elastic_membership_changes_total", (("kind", "Crashed"),))] == 0
    metrics.record(reformed(1, EpochCause.START, 0.02, "n0.0", "n1.0"))
    crash = MembershipChange(ChangeKind.CRASHED, 1, ("n1.0",), "crashed")
    metrics.record(JobEvent.of_change(crash, 101.0))
    metrics.record(reformed(2, EpochCause.FAILURE, 0.3, "n0.0"))
    joined = MembershipChange(ChangeKind.JOINED, 3, ("n1.0", "n2.0"), "joined")
    metrics.record(JobEvent.of_change(joined, 102.0))
    metrics.record(reformed(3, EpochCause.RESIZE, 2.0, "n0.0", "n1.0"))
    metrics.record(JobEvent(103.0, EventKind.FINISHED, 3, "done", succeeded=True))
    got = samples(metrics)
    assert got[("elastic_membership_changes_total", (("kind", "Crashed"),))] == 1
    assert got[("elastic_membership_changes_total", (("kind", "Joined"),))] == 2  # slots
    assert got[("elastic_membership_changes_total", (("kind", "Reformed"),))] == 3
    assert got[("elastic_recoveries_total", (("cause", "failure"),))] == 1
    assert got[("elastic_recoveries_total", (("cause", "resize"),))] == 1
    assert ("elastic_recoveries_total", (("cause", "start"),)) not in got
    assert got[("elastic_reform_seconds_count", (("cause", "failure"),))] == 1
    assert got[("elastic_reform_seconds_sum", (("cause", "resize"),))] == pytest.approx(2.0)
    assert got[("elastic_reform_seconds_bucket", (("cause", "failure"), ("le", "0.5")))] == 1
    assert got[("elastic_reform_seconds_bucket", (("cause", "resize"), ("le", "1.0")))] == 0
    assert got[("elastic_job_phase", (("elastic_job_phase", "succeeded"),))] == 1
    assert got[("elastic_job_phase", (("elastic_job_phase", "running"),))] == 0
    assert got[("elastic_restarts_limit", ())] == 3
    assert got[("elastic_job_info", (("job_id", "job-1"),))] == 1


def test_the_timeline_shows_each_epoch_and_fault(tmp_path: Path) -> None:
    events = [
        reformed(1, EpochCause.START, 0.01, "n0.0", "n1.0", "n2.0"),
        JobEvent(110.0, EventKind.CRASHED, 1, "crash", ("n1.0",)),
        reformed(2, EpochCause.FAILURE, 0.2, "n0.0", "n2.0"),
        JobEvent(113.0, EventKind.JOINED, 3, "join", ("n1.0",)),
        reformed(3, EpochCause.RESIZE, 1.5, "n0.0", "n2.0", "n1.0"),
        *(JobEvent(100.0 + t, EventKind.PROGRESS, 1, step=10 * t, size=3) for t in range(20)),
    ]
    picture = build(events)
    assert [e[2] for e in picture.epochs] == [1, 2, 3]
    assert picture.epochs[1][3] == ("n0.0", "n2.0")
    assert picture.epochs[0][1] == picture.epochs[1][0]  # epoch 1 ends where 2 starts
    assert [kind for _, kind, _ in picture.marks] == [EventKind.CRASHED, EventKind.JOINED]
    assert picture.rates and all(rate == pytest.approx(10.0) for _, rate in picture.rates)
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e.to_json()) for e in events) + "\nbroken\n")
    drawn, skipped = render_file(path, tmp_path / "out" / "job.png")
    assert drawn == picture and skipped == ["line 26: Expecting value: line 1 column 1 (char 0)"]
    assert (tmp_path / "out" / "job.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="no events"):
        build([])


def test_observer_flags_check_the_port_and_default_the_events_file() -> None:
    parser = argparse.ArgumentParser()
    add_observer_flags(parser)
    settings = observer_settings(parser.parse_args([]), "job-7")
    assert settings.metrics_port is None
    assert settings.events_file is not None and settings.events_file.name == "job-7.events.jsonl"
    assert observer_settings(parser.parse_args(["--metrics-port", "0"]), "j").metrics_port == 0
    with pytest.raises(ConfigError, match="--metrics-port 70000 is not a TCP port"):
        observer_settings(parser.parse_args(["--metrics-port", "70000"]), "j")
