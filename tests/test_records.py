"""The job's typed records: keys build and parse, values round-trip and reject malformed input,
and the snapshot reader skips junk (pure: no store)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from elastic_allreduce import codec
from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ConfigError, MalformedKeyError, MalformedValueError
from elastic_allreduce.records import keys
from elastic_allreduce.records.keys import KeyKind
from elastic_allreduce.records.snapshot import SkipReporter, parse_job
from elastic_allreduce.records.values import (
    NOT_ADMITTED_EXIT_CODE,
    Directive,
    EpochCause,
    ExitRecord,
    HangRank,
    HangRecord,
    JobConfig,
    JobPhase,
    JobSettings,
    JobStatus,
    LeaderRecord,
    MemberRecord,
    ProcPhase,
    ProcRecord,
    Progress,
    RankProgress,
    RanksRecord,
    Ring,
    RingState,
    ScaleTarget,
    ScriptError,
    from_leader,
)
from elastic_allreduce.rendezvous import protocol

SETTINGS = JobSettings(1, 3, 2, 4, wait_timeout=30.0)

#: One valid record of each type, at its key.
RECORDS: dict[str, Any] = {
    keys.LEADER: LeaderRecord("10.0.0.1:4000", "10.0.0.1:9090", "t0ken"),
    keys.JOB_CONFIG: JobConfig(SETTINGS, ("python", "train.py", "--lr", "0.1"), "/ckpt"),
    keys.SCALE_TARGET: ScaleTarget(3),
    keys.RING: Ring(
        4, ("n0.0", "n1.0"), RingState.FORMING, "h:1", ("n1.0",), EpochCause.RESIZE, 1, (3, 1)
    ),
    keys.JOB_STATUS: JobStatus(JobPhase.FAILED, "slot n0.0 crashed", leader=7587),
    keys.PROGRESS: Progress.of({"step": 12, "epoch": 1, "commit_id": 3, "lr": 0.5}, 2),
    keys.member("n0"): MemberRecord("10.0.0.2", 2, 1234, leaving=True),
    keys.proc("n0.1"): ProcRecord(99, 2, ProcPhase.TRAINING, 7, 3, 0.25),
    keys.exit_("n0.1", 2): ExitRecord.from_returncode(-9, ("Traceback", "boom")),
    keys.exit_("n0.1", 3): ExitRecord.from_returncode(
        1, ("ValueError: boom",), ScriptError("ValueError", "boom", 4, True, ("ValueError: boom",))
    ),
    keys.directive("n0"): Directive(((0, 1), (1, 3)), leader=7587),
    keys.RANKS: RanksRecord(
        3,
        1700000000.5,
        (
            RankProgress("n0.0", 0, 1, 120, 130, 0.031, None, 1700000000.25),
            RankProgress("n1.0", 1, 2, None, 0, None, "startup", None),
        ),
    ),
    keys.HANG: HangRecord(
        3,
        1700000001.0,
        12.5,
        "replacing slot n1.0 (at train.py:40 in train)",
        (
            HangRank(
                "n0.0", 0, 50, "Horovod allreduce (mpi_ops.py:1 in f)", "t.py:9 in g", "", True
            ),
            HangRank("n1.0", 1, 50, None, "train.py:40 in train", 'Thread "MainThread":\n', True),
            HangRank("n2.0", 2, None, None, "unknown", "", False),
        ),
    ),
}


@pytest.mark.parametrize("key", sorted(RECORDS))
def test_every_record_round_trips_through_the_stored_envelope(key: str) -> None:
    record = RECORDS[key]
    stored = codec.decode(key, codec.encode(record.to_json()))
    assert type(record).from_json(key, stored) == record


def test_every_key_parses_to_its_kind_and_names() -> None:
    assert keys.parse("launcher/leader") == keys.JobKey(KeyKind.LEADER)
    assert keys.parse("members/n0") == keys.JobKey(KeyKind.MEMBER, node="n0")
    assert keys.parse("procs/job-worker-3.1") == keys.JobKey(
        KeyKind.PROC, node="job-worker-3", slot="job-worker-3.1"
    )
    assert keys.parse("exits/n2.0/12") == keys.JobKey(
        KeyKind.EXIT, node="n2", slot="n2.0", incarnation=12
    )
    assert keys.parse("directives/n2").kind is KeyKind.DIRECTIVE
    assert {keys.parse(k).kind for k in RECORDS} == set(KeyKind)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("procs/x", "procs/<node-id>.<index>"),
        ("exits/n0.0/abc", "exits/<node-id>.<index>/<incarnation>"),
        ("exits/n0.0/0", "incarnations from 1"),
        ("exits/n0.0", "exits/<node-id>.<index>/<incarnation>"),
        ("members/n.0", "members/<node-id>"),
        ("members/N0", "members/<node-id>"),
        ("directives/a/b", "directives/<node-id>"),
        ("status/other", "not a key of this job's layout"),
        ("stray", "not a key of this job's layout"),
    ],
)
def test_a_key_of_no_known_shape_is_refused_with_the_expected_shape(key: str, why: str) -> None:
    with pytest.raises(MalformedKeyError, match=key) as raised:
        keys.parse(key)
    assert why in raised.value.reason


def test_key_builders_refuse_ids_that_would_not_parse_back() -> None:
    with pytest.raises(ConfigError, match="no dots"):
        keys.member("a.b")
    with pytest.raises(ValueError, match="not a slot id"):
        keys.proc("n0")
    with pytest.raises(ValueError, match="incarnations start at 1"):
        keys.exit_("n0.0", 0)
    assert keys.split_slot(keys.slot_id("w-1", 3)) == ("w-1", 3)


MALFORMED: list[tuple[type[Any], JsonValue, str]] = [
    (LeaderRecord, ["not", "an", "object"], "must be a JSON object"),
    (LeaderRecord, {"rendezvous": 5}, "'rendezvous' must be a string"),
    (LeaderRecord, {"rendezvous": "h:1", "dashboard": ["h"]}, "'dashboard' must be a string"),
    (LeaderRecord, {"rendezvous": "h:1", "token": 7}, "'token' must be a string"),
    (JobConfig, {**SETTINGS.to_json(), "command": []}, "empty command"),
    (JobConfig, {**SETTINGS.to_json(), "command": "python x.py"}, "list of strings"),
    (JobConfig, {"min_workers": 1, "command": ["x.py"]}, "'max_workers' must be an integer"),
    (JobSettings, {**SETTINGS.to_json(), "min_workers": 5}, "above max_workers"),
    (JobSettings, {**SETTINGS.to_json(), "nproc_per_node": 0}, "integer >= 1"),
    (JobSettings, {**SETTINGS.to_json(), "max_restarts": True}, "must be an integer"),
    (JobSettings, {**SETTINGS.to_json(), "wait_timeout": "soon"}, "finite number"),
    (ScaleTarget, {"workers": -1}, "integer >= 0"),
    (MemberRecord, {"slots": 1}, "'host' must be a string"),
    (MemberRecord, {"host": "h", "slots": 1, "leaving": "yes"}, "true or false"),
    (ProcRecord, {"pid": 3, "incarnation": 1, "phase": "dancing"}, "one of 'starting'"),
    (ProcRecord, {"pid": 3, "incarnation": 0, "phase": "starting"}, "integer >= 1"),
    (
        ProcRecord,
        {"pid": 3, "incarnation": 1, "phase": "starting", "warmup_step": -1},
        "a number >= 0",
    ),
    (ExitRecord, {"code": None, "signal": None}, "either a code or a signal"),
    (ExitRecord, {"code": 1, "signal": 9}, "either a code or a signal"),
    (ExitRecord, {"code": 1, "tail": [1, 2]}, "list of strings"),
    (ExitRecord, {"code": 1, "error": {"message": "m", "epoch": 0}}, "'kind' must be a string"),
    (ExitRecord, {"code": 1, "error": {"kind": "", "message": "m", "epoch": 0}}, "1-200 char"),
    (
        ExitRecord,
        {"code": 1, "error": {"kind": "E", "message": "m" * 2001, "epoch": 0}},
        "a message of at most 2000",
    ),
    (
        ExitRecord,
        {"code": 1, "error": {"kind": "E", "message": "m", "epoch": 0, "lines": ["x"] * 13}},
        "at most 12 lines",
    ),
    (ExitRecord, {"code": 1, "error": {"kind": "E", "message": "m", "epoch": -1}}, ">= 0"),
    (Directive, {"slots": {"0": 0}}, "incarnation >= 1"),
    (Directive, {"slots": {"x": 1}}, "slot index"),
    (Directive, {"slots": [1]}, "'slots' must be an object"),
    (JobStatus, {"phase": "finishing"}, "one of 'running', 'succeeded', 'failed'"),
    (Progress, {"step": 3, "size": 0}, "integer >= 1"),
    (RanksRecord, {"epoch": 1, "written_at": 0}, "'ranks' must be a list"),
    (
        RanksRecord,
        {"epoch": 1, "ranks": [{"slot": "n0", "rank": 0, "incarnation": 1, "ticks": 0}]},
        "not a slot",
    ),
    (
        RanksRecord,
        {"epoch": 1, "ranks": [{"slot": "n0.0", "rank": 0, "incarnation": 1, "ticks": -1}]},
        "integer >= 0",
    ),
    (HangRecord, {"epoch": 1, "action": "x", "ranks": [{"slot": "n0.0"}]}, "'rank' must be"),
    (HangRecord, {"epoch": 1, "ranks": []}, "'action' must be a string"),
    (Ring, {"epoch": 1, "slots": ["n0"], "state": "running", "rendezvous": "h:1"}, "not a slot"),
    (
        Ring,
        {"epoch": 1, "slots": ["n0.0", "n0.0"], "state": "running", "rendezvous": "h:1"},
        "twice",
    ),
    (Ring, {"epoch": 0, "slots": [], "state": "running", "rendezvous": "h:1"}, "integer >= 1"),
    (Ring, {"epoch": 1, "slots": [], "state": "gone", "rendezvous": "h:1"}, "'forming'"),
    (
        Ring,
        {"epoch": 1, "slots": [], "state": "running", "rendezvous": "h:1", "cause": "x"},
        "'resize'",
    ),
    (
        Ring,
        {
            "epoch": 1,
            "slots": ["n0.0"],
            "state": "running",
            "rendezvous": "h:1",
            "incarnations": [1, 2],
        },
        "2 incarnations for 1 slots",
    ),
    (
        Ring,
        {
            "epoch": 1,
            "slots": ["n0.0"],
            "state": "running",
            "rendezvous": "h:1",
            "incarnations": [-1],
        },
        "a list of integers >= 0",
    ),
]


@pytest.mark.parametrize(("record", "value", "why"), MALFORMED)
def test_a_malformed_value_raises_the_stores_error_naming_key_and_field(
    record: type[Any], value: JsonValue, why: str
) -> None:
    with pytest.raises(MalformedValueError, match="the-key") as raised:
        record.from_json("the-key", value)
    assert why in raised.value.reason, raised.value.reason


def test_exit_records_describe_how_the_process_ended() -> None:
    assert ExitRecord.from_returncode(-9).describe() == "killed by SIGKILL"
    assert ExitRecord.from_returncode(3).describe() == "exit code 3"
    assert ExitRecord.from_returncode(NOT_ADMITTED_EXIT_CODE).describe() == "not admitted"
    assert ExitRecord.from_returncode(0).succeeded
    assert ExitRecord(None, 200).describe() == "killed by signal 200"


def test_progress_keeps_only_scalar_attributes() -> None:
    progress = Progress.of({"step": 4, "weights": [1.0], "name": "x", "size": 9}, 3)
    assert progress.to_json() == {"name": "x", "step": 4, "size": 3}
    assert progress.get("step") == 4 and progress.get("weights") is None


def test_directives_say_which_incarnation_each_slot_runs() -> None:
    directive = Directive.from_json("d", {"slots": {"1": 4, "0": 2}})
    assert directive.incarnations == ((0, 2), (1, 4))
    assert (directive.get(0), directive.get(1), directive.get(2)) == (2, 4, 0)


@dataclass(frozen=True)
class FakeKV:
    """What the snapshot reads of a store's KeyValue (the real one is tested in tests/store)."""

    key: str
    payload: JsonValue
    mod_revision: int = 5
    create_revision: int = 2
    lease: int | None = None
    malformed: str | None = None

    @property
    def value(self) -> JsonValue:
        if self.malformed is not None:
            raise MalformedValueError(self.key, self.malformed)
        return self.payload


def test_the_snapshot_holds_one_typed_record_per_key() -> None:
    items = [FakeKV(key, record.to_json()) for key, record in RECORDS.items()]
    job = parse_job(items, revision=9)
    assert job.revision == 9 and job.skipped == () and not job.empty
    assert job.leader is not None and job.leader.record == RECORDS[keys.LEADER]
    assert job.config is not None and job.config.record.settings == SETTINGS
    assert job.ring is not None and job.ring.record.cause is EpochCause.RESIZE
    assert job.status is not None and job.status.record.phase.final
    assert job.target is not None and job.target.record.workers == 3
    assert job.progress is not None and job.progress.record.get("step") == 12
    assert job.members["n0"].record.leaving and job.members["n0"].create_revision == 2
    assert job.procs["n0.1"].record.phase is ProcPhase.TRAINING
    assert job.exits[("n0.1", 2)].record.signal == 9
    assert job.directives["n0"].record.get(1) == 3


def test_the_snapshot_skips_junk_keys_and_values_and_says_why() -> None:
    items = [
        FakeKV(keys.proc("n0.0"), ProcRecord(5, 1, ProcPhase.STARTING).to_json()),
        FakeKV("procs/x", {"pid": 1}),
        FakeKV("exits/n0.0/abc", {"code": 1}),
        FakeKV("members/a.b", {"host": "h", "slots": 1}),
        FakeKV("members/n1", {"host": "h"}),
        FakeKV("ring", None, malformed="not UTF-8 JSON"),
        FakeKV("whatever/else", 1),
    ]
    job = parse_job(items, revision=3)
    assert list(job.procs) == ["n0.0"]
    assert job.members == {} and job.ring is None
    reasons = {s.key: s.reason for s in job.skipped}
    assert set(reasons) == {
        "procs/x",
        "exits/n0.0/abc",
        "members/a.b",
        "members/n1",
        "ring",
        "whatever/else",
    }
    assert "'slots' must be an integer" in reasons["members/n1"]
    assert reasons["ring"] == "not UTF-8 JSON"
    reporter = SkipReporter()
    assert len(reporter.new(job)) == 6
    assert reporter.new(job) == []  # each junk value is reported once
    rewritten = parse_job([FakeKV("procs/x", {"pid": 2}, mod_revision=8)], revision=8)
    assert [s.key for s in reporter.new(rewritten)] == ["procs/x"]  # ...until it changes


def test_an_empty_prefix_is_an_unknown_job() -> None:
    assert parse_job([], revision=1).empty
    assert not parse_job([FakeKV(keys.SCALE_TARGET, {"workers": 2})], revision=1).empty


def test_the_leader_record_gives_the_rendezvous_with_its_token_and_never_logs_the_token() -> None:
    record = LeaderRecord("10.0.0.1:4000", None, "s3cret")
    assert record.endpoint() == protocol.Endpoint("10.0.0.1:4000", "s3cret")
    assert record.endpoint().headers() == {protocol.TOKEN_HEADER: "s3cret"}  # type: ignore[union-attr]
    assert LeaderRecord(None, None, "s3cret").endpoint() is None
    assert "s3cret" not in repr(record) and "s3cret" not in repr(record.endpoint())
    assert protocol.Endpoint("h:1").headers() == {}


def test_only_the_leader_s_stamp_is_obeyed() -> None:
    assert from_leader(7587, 7587)
    assert not from_leader(7587, 7588)  # another launcher's (a stale one, a forger's copy)
    assert not from_leader(None, 7587)  # unstamped: not written by a launcher of this version
    assert not from_leader(7587, None)  # no leader seen yet


def test_a_stamp_must_be_a_lease_id() -> None:
    with pytest.raises(MalformedValueError, match="leader"):
        Directive.from_json(keys.directive("n0"), {"slots": {}, "leader": "the boss"})
    with pytest.raises(MalformedValueError, match="leader"):
        JobStatus.from_json(keys.JOB_STATUS, {"phase": "failed", "leader": 0})
