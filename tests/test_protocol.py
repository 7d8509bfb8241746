"""The rendezvous protocol's encoders, decoders and URLs, and the output-line prefix (pure)."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic_allreduce import logprefix
from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.model import REMOVED, SlotAssignment
from elastic_allreduce.rendezvous.protocol import Admission
from tests.helpers.pickles import Exploit


def test_rank_and_size_is_six_integers_in_horovods_order() -> None:
    assignment = SlotAssignment(rank=2, size=3, cross_rank=2, cross_size=3)
    body = protocol.encode_assignment(assignment)
    assert body == b"2,3,0,1,2,3"
    assert protocol.decode_assignment(body) == assignment
    assert protocol.encode_assignment(REMOVED) == b"-1,-1,-1,-1,-1,-1"


def test_an_admission_carries_the_epoch_before_the_ranks() -> None:
    admission = Admission(7, SlotAssignment(rank=1, size=2, cross_rank=1, cross_size=2))
    body = protocol.encode_admission(admission)
    assert body == b"7,1,2,0,1,1,2"
    assert protocol.decode_admission(body) == admission
    refused = protocol.decode_admission(protocol.encode_admission(Admission(-1, REMOVED)))
    assert not refused.admitted and refused.assignment == REMOVED
    assert protocol.decode_epoch(protocol.encode_epoch(12)) == 12


@pytest.mark.parametrize(
    ("decode", "body"),
    [
        (protocol.decode_assignment, b"1,2,3"),
        (protocol.decode_assignment, b"a,b,c,d,e,f"),
        (protocol.decode_admission, b"1,2,0,1,0,1"),
        (protocol.decode_admission, b"\xff"),
        (protocol.decode_epoch, b""),
        (protocol.decode_epoch, b"3,4"),
    ],
)
def test_a_malformed_reply_is_a_protocol_error(
    decode: Callable[[bytes], object], body: bytes
) -> None:
    with pytest.raises(ProtocolError, match=r"bad \w+ reply"):
        decode(body)


def test_worker_keys_name_a_slot_with_local_rank_zero() -> None:
    assert protocol.worker_key("n0.1") == "n0.1:0"
    assert protocol.slot_of_worker_key(protocol.worker_key("job-w-2.0")) == "job-w-2.0"


def test_addresses_and_urls_bracket_ipv6() -> None:
    assert protocol.host_port("10.0.0.5", 80) == "10.0.0.5:80"
    assert protocol.host_port("::1", 80) == "[::1]:80"
    assert protocol.host_port("fe80::2", 8) == "[fe80::2]:8"
    assert protocol.host_port("launcher.ns.svc", 9) == "launcher.ns.svc:9"
    assert protocol.split_host_port("[::1]:4000") == ("::1", 4000)
    assert protocol.split_host_port("h:4000") == ("h", 4000)
    assert protocol.ready_url("[::1]:4000", "n0.0") == "http://[::1]:4000/elastic_ready/n0.0"
    assert protocol.epoch_url("127.0.0.1:5", "n1.2") == "http://127.0.0.1:5/elastic_epoch/n1.2"
    assert protocol.rank_and_size_url("h:5", "n1.2") == "http://h:5/rank_and_size/n1.2:0"
    for bad in ("nohost", "h:", ":80", "h:99999", "h:port"):
        with pytest.raises(ProtocolError, match="expected HOST:PORT"):
            protocol.split_host_port(bad)


def test_the_output_prefix_is_written_and_read_by_one_definition() -> None:
    line = logprefix.format_line("job-1", 3, 0, "n0.0", '{"event": "commit"}')
    assert line == '[job-1 e3 r0 n0.0] {"event": "commit"}'
    parsed = logprefix.parse_line(line)
    assert parsed == logprefix.OutputLine("job-1", 3, 0, "n0.0", '{"event": "commit"}')
    outside = logprefix.parse_line(logprefix.format_line("j", None, None, "n1.0", "starting"))
    assert outside is not None and (outside.epoch, outside.rank) == (None, None)
    assert logprefix.parse_line(logprefix.format_line("j", 1, 2, "n1.0", "")) is not None
    for other in ("plain text", "[bench] x", "[1]<stdout>:{}", "[j eX r0 n0.0] x"):
        assert logprefix.parse_line(other) is None, other


def test_a_real_worker_registration_is_read_as_plain_data() -> None:
    from horovod.runner.common.util import codec, secret  # noqa: PLC0415

    key = secret.make_secret_key()
    addresses = {"lo": [("127.0.0.1", 41234)], "eth0": [("10.0.0.3", 41234)]}
    body = codec.dumps_base64((addresses, key), to_ascii=False)
    worker = protocol.decode_worker_addresses(body)
    assert worker.secret_key == key
    assert worker.as_horovod() == addresses


def test_a_pickle_that_names_a_function_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in (Exploit(marker), ({"lo": [("h", 1)]}, Exploit(marker))):
        body = base64.b64encode(pickle.dumps(payload))
        with pytest.raises(ProtocolError, match="refused to load"):
            protocol.decode_worker_addresses(body)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Exploit(marker)))  # noqa: S301 - what a general loader does
    assert marker.exists()  # (so the payload above would have run)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"%%%", "not base64"),
        (base64.b64encode(b"\x80\x05junk"), "not plain pickled data"),
        (base64.b64encode(pickle.dumps(({"lo": [("h", 1)]},))), "must be ({interface"),
        (base64.b64encode(pickle.dumps(({"lo": [("h", 0)]}, b"k"))), "must be ({interface"),
        (base64.b64encode(pickle.dumps(({"lo": "h:1"}, b"k"))), "must be ({interface"),
        (base64.b64encode(pickle.dumps(({"lo": [("h", 1)]}, ""))), "must be ({interface"),
        (b"A" * (protocol.MAX_WORKER_ADDRESSES_BYTES + 1), "too large"),
    ],
)
def test_a_malformed_worker_registration_says_what_is_wrong(body: bytes, why: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        protocol.decode_worker_addresses(body)
    assert why in str(raised.value)


# -- progress reports (the hang watchdog's channel) ---------------------------------------------


def test_progress_reports_round_trip_and_urls_name_the_slot() -> None:
    report = protocol.ProgressReport(2, 41, 40, "evaluation", 0.125, 1000)
    assert protocol.ProgressReport.decode(report.encode()) == report
    assert protocol.ProgressReport.decode(protocol.ProgressReport(1, 0).encode()).phase is None
    committed = protocol.ProgressReport(
        3,
        9,
        commit=protocol.Commit(12, 120),
        synced=protocol.Synced(4, protocol.Commit(10, None)),
    )
    assert protocol.ProgressReport.decode(committed.encode()) == committed
    skipping = protocol.ProgressReport(1, 5, checkpoints_skipped=2, checkpoint_skip="disk full")
    assert protocol.ProgressReport.decode(skipping.encode()) == skipping
    reply = protocol.ProgressReply(send_stacks=True)
    assert protocol.ProgressReply.decode(reply.encode()) == reply
    stacks = protocol.StacksReport(1, None, "train.py:3 in f", 'Thread "MainThread":\n')
    assert protocol.StacksReport.decode(stacks.encode()) == stacks
    assert protocol.progress_url("[::1]:80", "n0.0") == "http://[::1]:80/progress/n0.0"
    assert protocol.stacks_url("h:80", "n0.0") == "http://h:80/stacks/n0.0"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"incarnation": 0, "ticks": 1}', "'incarnation' must be an integer >= 1"),
        (b'{"incarnation": 1, "ticks": true}', "'ticks' must be an integer"),
        (b'{"incarnation": 1, "ticks": 1, "step": -2}', "'step' must be an integer >= 0"),
        (b'{"incarnation": 1, "ticks": 1, "phase": 5}', "'phase' must be a printable string"),
        (b'{"incarnation": 1, "ticks": 1, "phase": "a\\nb"}', "printable"),
        (b'{"incarnation": 1, "ticks": 1, "step_seconds": -1}', "seconds >= 0"),
        (b'{"incarnation": 1, "ticks": 1, "step_seconds": NaN}', "seconds >= 0"),
        (b'{"incarnation": 1, "ticks": 1, "commit": 5}', "commit must be an object"),
        (b'{"incarnation": 1, "ticks": 1, "commit": {"step": 1}}', "'commit_id' must be an"),
        (b'{"incarnation": 1, "ticks": 1, "commit": {"commit_id": -1}}', "'commit_id' must be"),
        (
            b'{"incarnation": 1, "ticks": 1, "synced": {"commit_id": 1, "step": 2}}',
            "synced: field 'epoch' must be an integer",
        ),
        (
            b'{"incarnation": 1, "ticks": 1, "synced": {"epoch": 1, "commit_id": 1, "step": "x"}}',
            "'step' must be an integer",
        ),
        (
            b'{"incarnation": 1, "ticks": 1, "checkpoints_skipped": -1}',
            "'checkpoints_skipped' must be an integer >= 0",
        ),
        (
            b'{"incarnation": 1, "ticks": 1, "checkpoint_skip": "' + b"x" * 201 + b'"}',
            "'checkpoint_skip' must be a printable string of at most 200",
        ),
        (b"{" + b" " * 5000 + b"}", "too large"),
    ],
)
def test_a_malformed_progress_report_is_refused_with_the_reason(body: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        protocol.ProgressReport.decode(body)


def test_stacks_are_cut_to_fit_the_limit() -> None:
    huge = protocol.StacksReport(1, None, "x.py:1 in f", "frame\n" * 100_000)
    body = huge.encode()
    assert len(body) <= protocol.MAX_STACKS_BYTES
    assert protocol.StacksReport.decode(body).stacks.endswith("[cut]")


def test_node_standing_round_trips_and_refuses_junk() -> None:
    for standing in (protocol.NodeStanding(7, True), protocol.NodeStanding(0, False)):
        assert protocol.NodeStanding.decode(standing.encode()) == standing
    for junk in (b"", b"7", b"7,2", b"-1,1", b"a,b", b"1,1,1"):
        with pytest.raises(ProtocolError):
            protocol.NodeStanding.decode(junk)
    assert protocol.standing_url("[::1]:80", "n1") == "http://[::1]:80/node_standing/n1"


def test_a_token_is_random_and_only_the_same_token_is_authorized() -> None:
    token = protocol.new_token()
    assert len(token) >= 43 and token != protocol.new_token()
    assert protocol.authorized(token, token)
    assert not protocol.authorized(None, token)
    assert not protocol.authorized("", token)
    assert not protocol.authorized(token[:-1], token)
    assert not protocol.authorized(token + "x", token)
