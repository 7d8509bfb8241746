"""Plain data between ranks (elastic_allreduce.agreement.plain): the extra attributes' JSON wire
form, the
refusal of anything that is not plain data, malformed and pickled payloads, and the commit-time
host-update vote that replaces Horovod's pickled broadcast. Pure: no Horovod."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from horovod.runner.elastic.worker import HostUpdateResult

from elastic_allreduce.agreement import plain
from elastic_allreduce.agreement.plain import HostUpdateVote, decide
from elastic_allreduce.errors import (
    ConfigError,
    ProtocolError,
    StateMismatchError,
    StateValueError,
)
from tests.helpers.pickles import Exploit

#: What the examples, the tests' scripts and the model zoo keep in a State.
ZOO_LIKE = {
    "commit_id": 7,
    "epoch": 2,
    "position": 640,
    "step": 31,
    "loss_sum": 12.5,
    "loss_count": 10.0,
    "train_loss": None,
    "evaluated_at": -1,
    "metrics": {"accuracy": 0.913, "per_class": [0.5, 0.25]},
    "rings": [[1, 3, 0], [2, 2, 17]],
    "data": "3f2a9c0e11d2b7a4",
    "stopped": False,
    "name": "héllo ✓",
}


def decode(raw: bytes) -> dict[str, object]:
    return plain.decode_attributes(raw, sender="rank 0")


# -- the attributes ----------------------------------------------------------------------------


def test_attributes_round_trip_as_json() -> None:
    raw = plain.encode_attributes(ZOO_LIKE)
    assert json.loads(raw) == {"version": plain.VERSION, "attributes": ZOO_LIKE}
    decoded = plain.decode_attributes(raw, sender="rank 0", expected=ZOO_LIKE.keys())
    assert decoded == ZOO_LIKE
    assert list(decoded) == list(ZOO_LIKE)  # the order the attributes are set in
    assert type(decoded["loss_count"]) is float
    assert type(decoded["step"]) is int


def test_floats_round_trip_exactly_and_non_finite_ones_too() -> None:
    values = {"a": 0.1 + 0.2, "b": 1e-308, "inf": math.inf, "ninf": -math.inf, "nan": math.nan}
    decoded = decode(plain.encode_attributes(values))
    assert decoded["a"] == 0.1 + 0.2
    assert decoded["b"] == 1e-308
    assert decoded["inf"] == math.inf
    assert decoded["ninf"] == -math.inf
    assert math.isnan(decoded["nan"])  # type: ignore[arg-type]


def test_numpy_scalars_become_python_values() -> None:
    converted = plain.plain_attributes(
        {
            "step": np.int64(5),
            "loss": np.float32(0.5),
            "done": np.bool_(True),
            "deep": {"x": [np.int32(1), np.float64(2.5)]},
            "label": np.str_("cat"),
        }
    )
    assert converted == {
        "step": 5,
        "loss": 0.5,
        "done": True,
        "deep": {"x": [1, 2.5]},
        "label": "cat",
    }
    assert type(converted["step"]) is int
    assert type(converted["loss"]) is float
    assert type(converted["done"]) is bool
    assert type(converted["label"]) is str


def test_a_commit_keeps_a_copy_not_the_live_lists() -> None:
    rings = [[1, 3, 0]]
    converted = plain.plain_attributes({"rings": rings})
    rings.append([2, 2, 5])
    assert converted == {"rings": [[1, 3, 0]]}


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ((1, 2), "is of type tuple (use a list)"),
        (np.zeros(3), "is of type numpy.ndarray (use .tolist())"),
        ({1, 2}, "is of type set"),
        (b"raw", "is of type bytes"),
        (object(), "is of type object"),
        (Path("/tmp"), "is of type pathlib.PosixPath"),
        (np.complex64(1j), "is of type numpy.complex64"),
    ],
)
def test_values_that_are_not_plain_are_refused_naming_the_attribute(
    value: object, named: str
) -> None:
    with pytest.raises(StateValueError) as caught:
        plain.plain_attributes({"step": 1, "history": value})
    message = str(caught.value)
    assert message.startswith(f"State attribute 'history' {named}, not plain data."), message
    assert plain.ALLOWED in message
    assert "never pickled" in message


def test_the_refusal_names_where_inside_a_nested_value() -> None:
    with pytest.raises(StateValueError, match=r"'metrics' at \['val'\]\[1\] is of type tuple"):
        plain.plain_attributes({"metrics": {"val": [0.5, (1, 2)]}})
    with pytest.raises(StateValueError, match=r"'metrics' at \['val'\] has the dict key 3 of"):
        plain.plain_attributes({"metrics": {"val": {3: "x"}}})


def test_a_refusal_is_a_config_error_and_fails_the_job_like_a_mismatch() -> None:
    # StateMismatchError: the bootstrap exits with the code that fails the job at once.
    assert issubclass(StateValueError, ConfigError)
    assert issubclass(StateValueError, StateMismatchError)


def test_subclasses_of_plain_types_are_refused() -> None:
    # They would arrive as the base type on the other ranks.
    from collections import OrderedDict  # noqa: PLC0415

    with pytest.raises(StateValueError, match=r"collections\.OrderedDict"):
        plain.plain_attributes({"seen": OrderedDict(a=1)})


def test_too_deep_and_too_large_are_refused() -> None:
    deep: list[object] = []
    for _ in range(plain.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(StateValueError, match="nested deeper than"):
        plain.plain_attributes({"deep": deep})
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(StateValueError, match="nested deeper than"):
        plain.plain_attributes({"looped": looped})
    with pytest.raises(StateValueError, match="more than"):
        plain.encode_attributes({"big": "x" * plain.MAX_BYTES})


# -- what a peer may send -------------------------------------------------------------------------


def test_a_pickle_from_a_peer_is_refused_and_never_loaded(tmp_path: Path) -> None:
    marker = tmp_path / "pickle-ran"
    # What Horovod's broadcast_object sends: a pickled dict of attributes (cloudpickle reads it).
    crafted = pickle.dumps({"step": 1, "commit_id": 2, "epoch": Exploit(marker)})
    with pytest.raises(ProtocolError, match="sent by rank 0 are not UTF-8 JSON"):
        decode(crafted)
    with pytest.raises(ProtocolError):
        decode(pickle.dumps(Exploit(marker), protocol=0))  # ASCII protocol: valid UTF-8
    assert not marker.exists()


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"", "not UTF-8 JSON"),
        (b"\xff\xfe{}", "not UTF-8 JSON"),
        (b'{"version": 1, "attributes": {"step": 1}', "not UTF-8 JSON"),
        (b"[1, 2]", 'not {"version": ..., "attributes": ...}'),
        (b'{"version": 1}', 'not {"version": ..., "attributes": ...}'),
        (b'{"version": 1, "attributes": {}, "code": "x"}', 'not {"version"'),
        (b'{"version": 2, "attributes": {}}', "version 2, this rank reads 1"),
        (b'{"version": true, "attributes": {}}', "version True"),
        (b'{"version": 1, "attributes": []}', "'attributes' is not a JSON object"),
        (b'{"version": 1, "attributes": {"a": 1, "a": 2}}', "a key appears twice"),
        (b'{"version": 1, "attributes": {"commit_id": "3"}}', "commit_id '3'"),
        (b'{"version": 1, "attributes": {"commit_id": -1}}', "commit_id -1"),
        (b'{"version": 1, "attributes": {"x": ' + b"[" * 100 + b"]" * 100 + b"}}", "deeper"),
        (b'{"version": 1, "attributes": {"x": ' + b"[" * 10**6 + b"}}", "not UTF-8 JSON"),
        (b'{"version": 1, "attributes": {"x": ' + b"9" * 5000 + b"}}", "not UTF-8 JSON"),
    ],
)
def test_malformed_payloads_are_protocol_errors(raw: bytes, says: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(raw)
    assert says in str(caught.value)
    assert "the state attributes sent by rank 0" in str(caught.value)


def test_a_payload_with_other_attributes_than_this_rank_s_is_refused() -> None:
    raw = plain.encode_attributes({"commit_id": 1, "step": 3, "extra": 1})
    with pytest.raises(ProtocolError, match=r"are \['commit_id', 'extra', 'step'\], this rank"):
        plain.decode_attributes(raw, sender="rank 0", expected=("commit_id", "step"))


def test_an_oversized_payload_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="more than"):
        decode(b" " * (plain.MAX_BYTES + 1))


# -- the host-update vote ----------------------------------------------------------------------


def test_the_bits_are_horovod_s() -> None:
    assert HostUpdateResult.removed == plain.REMOVED
    assert HostUpdateResult.added == plain.ADDED


def test_no_notification_no_interrupt() -> None:
    vote = HostUpdateVote.drain(5, [])
    assert vote == HostUpdateVote(5, 5, 0, 0, 0)
    verdict = decide(vote.vector(), 2)
    assert (verdict.timestamp, verdict.interrupt, verdict.refused_rank) == (5, False, None)


def test_drain_keeps_horovod_s_filter_newer_than_every_one_before() -> None:
    added, removed = int(HostUpdateResult.added), int(HostUpdateResult.removed)
    # 3 is not newer than what was seen; 6 after 7 is not newer than 7.
    vote = HostUpdateVote.drain(4, [(3, added), (7, removed), (6, added)])
    assert vote == HostUpdateVote(4, 7, 7, 0, 0)
    vote = HostUpdateVote.drain(4, [(5, added), (7, removed)])
    assert vote == HostUpdateVote(4, 7, 7, 5, 0)
    mixed = int(HostUpdateResult.mixed)
    assert HostUpdateVote.drain(0, [(2, mixed)]) == HostUpdateVote(0, 2, 2, 2, 0)


def reduce_max(*votes: HostUpdateVote) -> list[int]:
    return [max(column) for column in zip(*(v.vector() for v in votes), strict=True)]


def test_a_notification_on_any_rank_interrupts_every_rank() -> None:
    # Horovod's broadcast takes rank 0's view: a notification that reached only rank 1 is
    # dropped there. The Max allreduce counts it.
    rank0 = HostUpdateVote.drain(3, [])
    rank1 = HostUpdateVote.drain(3, [(4, int(HostUpdateResult.added))])
    verdict = decide(reduce_max(rank0, rank1), 2)
    assert (verdict.timestamp, verdict.interrupt, verdict.skip_sync) == (4, True, False)


def test_skip_sync_only_when_every_new_notification_removed_hosts() -> None:
    removed, added = int(HostUpdateResult.removed), int(HostUpdateResult.added)
    only_removed = decide(
        reduce_max(HostUpdateVote.drain(3, [(4, removed)]), HostUpdateVote.drain(3, [])), 2
    )
    assert only_removed.interrupt and only_removed.skip_sync
    # Removed on one rank, added on another (Horovod's "mixed"): sync.
    both = decide(
        reduce_max(HostUpdateVote.drain(3, [(4, removed)]), HostUpdateVote.drain(3, [(5, added)])),
        2,
    )
    assert both.interrupt and not both.skip_sync
    # A notification without bits (no_update) still interrupts, and syncs (Horovod's rule).
    bare = decide(HostUpdateVote.drain(3, [(4, 0)]).vector(), 1)
    assert bare.interrupt and not bare.skip_sync


def test_a_newcomer_s_stale_notification_does_not_interrupt_the_ring() -> None:
    # A new process has seen nothing (0); a resent notification of the epoch it joined (4) is
    # not newer than what the survivors acted on. Horovod's broadcast of rank 0's view drops it
    # as well.
    survivor = HostUpdateVote.drain(4, [])
    newcomer = HostUpdateVote.drain(0, [(4, int(HostUpdateResult.added))])
    verdict = decide(reduce_max(survivor, newcomer), 2)
    assert (verdict.timestamp, verdict.interrupt) == (4, False)
    # ... and the survivors' older removal does not make a later interrupt skip its sync.
    stale_removal = HostUpdateVote.drain(0, [(4, int(HostUpdateResult.removed))])
    fresh_add = HostUpdateVote.drain(4, [(5, int(HostUpdateResult.added))])
    verdict = decide(reduce_max(stale_removal, fresh_add), 2)
    assert verdict.interrupt and not verdict.skip_sync


def test_the_lowest_refusing_rank_is_named_on_every_rank() -> None:
    size = 4
    votes = [HostUpdateVote.drain(0, [], refused=size - r if r in (1, 3) else 0) for r in range(4)]
    assert decide(reduce_max(*votes), size).refused_rank == 1
    assert decide(reduce_max(*votes[:1]), size).refused_rank is None


def test_a_vote_of_another_length_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="expected 6 integers"):
        decide([1, 2, 3], 2)


# -- batched votes -----------------------------------------------------------------------------


def test_the_first_commit_after_a_sync_votes_and_the_vote_sets_the_next_one() -> None:
    clock = plain.VoteClock()
    clock, votes = clock.commit()
    assert votes  # the first commit after a sync: nothing measured yet, vote now
    assert clock.asks(now=10.0, interval=0.5) == 1
    clock = clock.voted(10.0, next_in=1)
    # Five commits of 0.1 s each until the next vote (1 commit later, as agreed).
    clock, votes = clock.commit()
    assert votes and clock.asks(now=10.1, interval=0.5) == 5
    clock = clock.voted(10.1, next_in=5)
    for _ in range(4):
        clock, votes = clock.commit()
        assert not votes
    clock, votes = clock.commit()
    assert votes and clock.commits == 7


def test_every_rank_votes_at_the_commit_agreed_even_when_their_paces_differ() -> None:
    # Rank 0 measured 0.1 s per commit, rank 1 0.05 s: they ask 5 and 10; the Max of the
    # negated asks is the fewest, and both count to the same commit.
    fast = plain.HostUpdateVote.drain(3, [], next_in=5)
    slow = plain.HostUpdateVote.drain(3, [], next_in=10)
    verdict = decide(reduce_max(fast, slow), 2)
    assert verdict.next_in == 5 and not verdict.interrupt
    clocks = [plain.VoteClock(commits=2, due=2, voted_at=t, voted_commits=1) for t in (0.0, 9.0)]
    clocks = [c.voted(now, verdict.next_in) for c, now in zip(clocks, (0.2, 9.1), strict=True)]
    due = []
    for agreed in clocks:
        counted, votes = agreed, False
        while not votes:
            counted, votes = counted.commit()
        due.append(counted.commits)
    assert due == [7, 7]


def test_an_interval_of_zero_votes_at_every_commit_and_asks_are_bounded() -> None:
    clock = plain.VoteClock(commits=10, due=10, voted_at=0.0, voted_commits=5)
    assert clock.asks(now=1.0, interval=0.0) == 1
    assert clock.asks(now=1.0, interval=1000.0) == plain.MOST_COMMITS_PER_VOTE
    assert clock.asks(now=0.0, interval=0.5) == plain.MOST_COMMITS_PER_VOTE  # no time passed
    # A vector from a peer asking for more than the most is bounded by the verdict.
    assert decide([0, 0, 0, 0, 0, -(10**6)], 2).next_in == plain.MOST_COMMITS_PER_VOTE
    assert decide([0, 0, 0, 0, 0, 7], 2).next_in == 1
