"""launcher.leader.stragglers, step by step: which rank holds a synchronous ring back; and the
--straggler-factor job option (pure: no processes)."""

from __future__ import annotations

import argparse
import math

import pytest

from elastic_allreduce.errors import ConfigError, ProtocolError
from elastic_allreduce.records.values import JobSettings, StragglerPolicy
from elastic_allreduce.rendezvous.protocol import ProgressReport
from launcher import job_options
from launcher.leader.policy import NodeState
from launcher.leader.stragglers import Straggler, StragglerWatch
from launcher.vocabulary import Log, Member, StartNodes, StopNode
from tests.test_policy import of, started_job, step

RING = ("n0.0", "n1.0", "n2.0")


class Ranks:
    """The ring's reports: each rank's step time and its wait in the allreduce."""

    def __init__(self) -> None:
        self.ticks = 0
        self.incarnations: dict[str, int] = {}

    def reports(self, step: float, shares: dict[str, float]) -> dict[str, ProgressReport]:
        """One new report per rank: every rank's step takes ``step`` seconds (a synchronous
        ring), of which ``shares[slot]`` is the rank's own; the rest it waited."""
        self.ticks += 1
        return {
            slot: ProgressReport(
                self.incarnations.get(slot, 1),
                self.ticks,
                step_seconds=step,
                collective_seconds=step - share,
            )
            for slot, share in shares.items()
        }


def feed(watch: StragglerWatch, ranks: Ranks, times: int, **shares: float) -> list[Straggler]:
    found: list[Straggler] = []
    for _ in range(times):
        found += watch.step(RING, ranks.reports(0.2, {f"{k}.0": v for k, v in shares.items()}))
    return found


def test_a_rank_twice_as_slow_as_the_others_is_found_once_the_window_is_full() -> None:
    watch, ranks = StragglerWatch(factor=2.0, window=5), Ranks()
    assert feed(watch, ranks, 4, n0=0.05, n1=0.05, n2=0.2) == []  # the window fills first
    (found,) = feed(watch, ranks, 1, n0=0.05, n1=0.05, n2=0.2)
    assert found.slot == "n2.0" and found.factor == pytest.approx(4.0)
    assert (found.share, found.others) == pytest.approx((0.2, 0.05))
    assert "slot n2.0 is a straggler" in found.describe() and "4.0x" in found.describe()
    # Announced once while it lags ...
    assert feed(watch, ranks, 10, n0=0.05, n1=0.05, n2=0.2) == []
    # ... and again only after it recovered and fell behind anew.
    assert feed(watch, ranks, 5, n0=0.05, n1=0.05, n2=0.05) == []
    assert [s.slot for s in feed(watch, ranks, 5, n0=0.05, n1=0.05, n2=0.2)] == ["n2.0"]


def test_a_uniformly_slow_ring_and_a_slightly_slower_rank_have_no_straggler() -> None:
    watch, ranks = StragglerWatch(factor=2.0, window=5), Ranks()
    assert feed(watch, ranks, 20, n0=0.5, n1=0.5, n2=0.5) == []
    assert feed(watch, ranks, 20, n0=0.05, n1=0.06, n2=0.09) == []


def test_one_slow_report_in_a_window_is_not_a_straggler() -> None:
    watch, ranks = StragglerWatch(factor=2.0, window=5), Ranks()
    feed(watch, ranks, 5, n0=0.05, n1=0.05, n2=0.05)
    assert feed(watch, ranks, 2, n0=0.05, n1=0.05, n2=0.5) == []  # a median, not a mean


def test_the_same_report_again_is_not_a_new_sample_and_a_restarted_rank_starts_over() -> None:
    watch, ranks = StragglerWatch(factor=2.0, window=3), Ranks()
    reports = ranks.reports(0.2, {"n0.0": 0.05, "n1.0": 0.05, "n2.0": 0.2})
    for _ in range(5):  # the beacon was late: the launcher sees the same reports again
        assert watch.step(RING, reports) == []
    assert feed(watch, ranks, 1, n0=0.05, n1=0.05, n2=0.2) == []  # 2 samples of 3
    # n2.0's process restarts: its samples start again (its new incarnation is a new rank).
    ranks.incarnations["n2.0"] = 2
    assert feed(watch, ranks, 2, n0=0.05, n1=0.05, n2=0.2) == []
    assert [s.slot for s in feed(watch, ranks, 1, n0=0.05, n1=0.05, n2=0.2)] == ["n2.0"]


def test_a_rank_without_a_measured_wait_or_a_missing_report_stops_the_judging() -> None:
    watch, ranks = StragglerWatch(factor=2.0, window=3), Ranks()
    for _ in range(6):
        reports = ranks.reports(0.2, {"n0.0": 0.05, "n1.0": 0.05, "n2.0": 0.2})
        reports["n1.0"] = ProgressReport(1, ranks.ticks, step_seconds=0.2)  # Keras fit: no wait
        assert watch.step(RING, reports) == []
    partial = ranks.reports(0.2, {"n0.0": 0.05, "n2.0": 0.2})
    assert watch.step(RING, partial) == []


def test_a_warm_joiner_s_step_is_judged_against_the_ring_s_share_once() -> None:
    watch, ranks = StragglerWatch(factor=2.0, window=3), Ranks()
    feed(watch, ranks, 2, n0=0.05, n1=0.06, n2=0.07)
    assert watch.newcomer("j9.0", 1, 0.5) is None  # no full window yet: judged later
    feed(watch, ranks, 1, n0=0.05, n1=0.06, n2=0.07)
    slow = watch.newcomer("j9.0", 1, 0.15)
    assert slow is not None and slow.slow and slow.ring == pytest.approx(0.06)
    assert slow.factor == pytest.approx(2.5)
    assert "slot j9.0 warmed up: one step 0.150 s" in slow.describe()
    assert "2.5x the ring's share of a step (0.060 s): slow" in slow.describe()
    assert watch.newcomer("j9.0", 1, 0.15) is None  # once per process
    fine = watch.newcomer("j9.0", 2, 0.1)  # its next incarnation is judged again
    assert fine is not None and not fine.slow and fine.describe().endswith("not slow")
    # A ring uniformly slower than the newcomer's machine: never slow.
    assert watch.newcomer("j8.0", 1, 0.01) is not None
    judged = watch.newcomer("j7.0", 1, 0.12)
    assert judged is not None and not judged.slow


def test_the_wait_travels_in_the_progress_report() -> None:
    report = ProgressReport(1, 3, step_seconds=0.25, collective_seconds=0.125)
    assert ProgressReport.decode(report.encode()) == report
    for bad in (b"-1", b"NaN", b'"x"', b"true"):
        body = b'{"incarnation": 1, "ticks": 1, "collective_seconds": ' + bad + b"}"
        with pytest.raises(ProtocolError, match="collective_seconds must be seconds >= 0"):
            ProgressReport.decode(body)


def test_the_straggler_factor_is_a_job_option_stored_with_the_job() -> None:
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    default = job_options.job_options(["python", "t.py"])
    assert job_options.job_settings(default).straggler_factor == 2.0
    assert "--straggler-factor" not in job_options.to_args(default)
    parsed = job_options.from_args(parser.parse_args(["--straggler-factor", "3", "--", "t.py"]))
    settings = job_options.job_settings(parsed)
    assert settings.straggler_factor == 3.0
    assert JobSettings.from_json("config/job", settings.to_json()) == settings
    assert job_options.from_args(parser.parse_args(job_options.to_args(parsed))) == parsed
    older = {k: v for k, v in settings.to_json().items() if k != "straggler_factor"}
    assert JobSettings.from_json("config/job", older).straggler_factor == 2.0
    assert job_options.job_options(["t.py"], straggler_factor=0).straggler_factor == 0.0
    for bad, shown in [(1.0, "1"), (0.5, "0.5"), (-2.0, "-2"), (math.nan, "nan")]:
        with pytest.raises(ConfigError) as caught:
            job_options.job_options(["t.py"], straggler_factor=bad)
        assert str(caught.value).startswith(
            f"--straggler-factor must be 0 (not watched) or above 1, got {shown}"
        )


# -- --straggler-policy evict ---------------------------------------------------------------------


def test_evicting_pays_off_only_when_the_others_would_step_faster_without_it() -> None:
    assert Straggler("n1.0", 0.3, 0.1).faster_without(2)  # 3x > 2/1
    assert not Straggler("n1.0", 0.19, 0.1).faster_without(2)  # the other would take 0.2 s
    assert Straggler("n1.0", 0.16, 0.1).faster_without(3)  # 1.6x > 3/2
    assert not Straggler("n1.0", 0.3, 0.1).faster_without(1)


def test_an_evicted_straggler_s_node_is_stopped_and_replaced_without_a_restart() -> None:
    policy, world, _ = started_job(max_restarts=0)
    decisions = policy.evict("n1.0", "a straggler, 3.0x", world.view())
    assert StopNode("n1") in decisions
    assert "evicting node n1 (a straggler, 3.0x); starting another in its place" in [
        d.message for d in of(Log, decisions)
    ]
    assert policy.node_state("n1") is NodeState.STOPPING
    # Its agent leaves gracefully; the target stays, so another node is asked for at once.
    world.members["n1"] = Member("n1", 1, True, world.members["n1"].registered)
    assert StartNodes(1) in step(policy, world)
    assert policy.target_workers == 3 and policy.restarts_used == 0
    # A node that joined by itself cannot be stopped or replaced by the launcher.
    world.add_node("j9")
    step(policy, world)
    (refused,) = of(Log, policy.evict("j9.0", "a straggler", world.view()))
    assert "joined by itself" in refused.message


def test_the_straggler_policy_is_a_job_option_stored_with_the_job() -> None:
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    default = job_options.job_options(["t.py"])
    assert job_options.job_settings(default).straggler_policy is StragglerPolicy.REPORT
    assert "--straggler-policy" not in job_options.to_args(default)
    parsed = job_options.from_args(parser.parse_args(["--straggler-policy", "evict", "--", "t.py"]))
    settings = job_options.job_settings(parsed)
    assert settings.straggler_policy is StragglerPolicy.EVICT
    assert JobSettings.from_json("config/job", settings.to_json()) == settings
    assert job_options.from_args(parser.parse_args(job_options.to_args(parsed))) == parsed
    with pytest.raises(ConfigError, match="--straggler-policy must be report or evict"):
        job_options.job_options(["t.py"], straggler_policy="shoot")
