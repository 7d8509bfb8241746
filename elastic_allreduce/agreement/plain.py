"""What the ranks exchange besides tensors, as plain data: parsed, never unpickled (pure: no I/O).

Horovod's elastic states send two things with ``broadcast_object``, which cloudpickles them and
loads the bytes on the receivers (whatever the bytes name would run there): the extra
attributes at every sync, and a ``(timestamp, timestamp, update)`` tuple at every commit.
elastic_allreduce sends neither (:mod:`elastic_allreduce.agreement.sync` does the collectives):

* **The extra attributes** (``step``, ``epoch``, ``commit_id``, the script's own) must be plain
  data: None, bool, int, float (NaN and the infinities too), str, lists of these and dicts with
  str keys; NumPy scalars are converted to Python's. Anything else (a tuple, an array, an
  object) is refused with :class:`~elastic_allreduce.errors.StateValueError` naming the
  attribute. The sync's root sends them as one JSON object (:func:`encode_attributes`), and
  every rank -- the root too, so they all hold the same values -- parses the same bytes field
  by field (:func:`decode_attributes`): anything malformed is a ProtocolError on every rank.
* **The host-update vote** at a commit: six integers per rank (:class:`HostUpdateVote`),
  combined by one Max allreduce, from which every rank reaches the same verdict
  (:func:`decide`). The votes are batched (:class:`VoteClock`): the ranks vote at the first
  commit after each sync and then about every :data:`VOTE_INTERVAL` seconds, agreeing at each
  vote how many commits later the next one is -- the same commit on every rank, since every
  rank commits at the same points.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ProtocolError, StateValueError

#: Version of the attributes' wire form; a payload of another version is refused.
VERSION: Final = 1
#: The most bytes the attributes may take as JSON (they are counters and small records).
MAX_BYTES: Final = 16 * 2**20
#: The deepest nesting of lists and dicts an attribute may have.
MAX_DEPTH: Final = 64
#: What a State attribute may be, for messages.
ALLOWED: Final = (
    "None, bool, int, float, str, lists of these and dicts with str keys (NumPy scalars are "
    "converted)"
)

_SCALARS: Final = (type(None), bool, int, float, str)


# -- the extra attributes ----------------------------------------------------------------------


def plain_attributes(attributes: Mapping[str, object]) -> dict[str, JsonValue]:
    """A plain copy of the attributes (NumPy scalars converted); StateValueError names the first
    attribute that is not plain data and says what is allowed."""
    plain: dict[str, JsonValue] = {}
    for name, value in attributes.items():
        if type(name) is not str:
            raise StateValueError(f"State attribute names must be str, got {name!r}")
        plain[name] = _plain(value, name, "", 0)
    return plain


def _plain(value: object, name: str, path: str, depth: int) -> JsonValue:
    kind = type(value)
    if kind in _SCALARS:
        return value  # type: ignore[return-value]
    if isinstance(value, np.generic):
        converted = _numpy_scalar(value)
        if converted is not None:
            return converted
    elif kind in (list, dict) and depth >= MAX_DEPTH:
        raise StateValueError(
            f"State attribute {name!r}{_at(path)} is nested deeper than {MAX_DEPTH} levels. "
            f"{_rule()}"
        )
    elif isinstance(value, list) and kind is list:
        return [_plain(v, name, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    elif isinstance(value, dict) and kind is dict:
        plain: dict[str, JsonValue] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise StateValueError(
                    f"State attribute {name!r}{_at(path)} has the dict key {key!r} of type "
                    f"{_type_name(key)}, not str. {_rule()}"
                )
            plain[key] = _plain(item, name, f"{path}[{key!r}]", depth + 1)
        return plain
    hint = {tuple: " (use a list)", np.ndarray: " (use .tolist())"}.get(kind, "")
    raise StateValueError(
        f"State attribute {name!r}{_at(path)} is of type {_type_name(value)}{hint}, not plain "
        "data. "
        f"{_rule()}"
    )


def _numpy_scalar(value: np.generic) -> JsonValue:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.str_):
        return str(value)
    return None  # complex, datetime, bytes, void: refused by the caller


def _at(path: str) -> str:
    return f" at {path}" if path else ""


def _rule() -> str:
    return (
        "The ranks exchange State attributes as JSON, never pickled, so each must be plain "
        f"data: {ALLOWED}"
    )


def _type_name(value: object) -> str:
    kind = type(value)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def encode_attributes(attributes: Mapping[str, object]) -> bytes:
    """The wire form of the attributes: ``{"version": 1, "attributes": {...}}`` as UTF-8 JSON.
    StateValueError when one is not plain data or they take more than MAX_BYTES."""
    payload = {"version": VERSION, "attributes": plain_attributes(attributes)}
    raw = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    if len(raw) > MAX_BYTES:
        raise StateValueError(
            f"the State's attributes take {len(raw)} bytes as JSON, more than the "
            f"{MAX_BYTES} a sync sends: keep large data out of the State's attributes"
        )
    return raw


def decode_attributes(
    raw: bytes, *, sender: str, expected: Collection[str] | None = None
) -> dict[str, JsonValue]:
    """The attributes in ``raw`` (from :func:`encode_attributes` on ``sender``), checked field
    by field; with ``expected``, exactly those names. ProtocolError says what is wrong; nothing
    in the bytes is run."""
    where = f"the state attributes sent by {sender}"
    if len(raw) > MAX_BYTES:
        raise ProtocolError(f"{where} take {len(raw)} bytes, more than {MAX_BYTES}")
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, a repeated key, an int too long to parse.
        raise ProtocolError(f"{where} are not UTF-8 JSON ({exc}): {raw[:60]!r}") from exc
    if not isinstance(value, dict) or set(value) != {"version", "attributes"}:
        raise ProtocolError(f'{where} are not {{"version": ..., "attributes": ...}}: {raw[:60]!r}')
    version = value["version"]
    if type(version) is not int or version != VERSION:
        raise ProtocolError(
            f"{where} have version {version!r}, this rank reads {VERSION}: run the same "
            "elastic-allreduce release on every worker"
        )
    attributes = value["attributes"]
    if not isinstance(attributes, dict):
        raise ProtocolError(f"{where}: 'attributes' is not a JSON object")
    try:
        plain = plain_attributes(attributes)
    except StateValueError as exc:
        raise ProtocolError(f"{where}: {exc}") from exc
    if expected is not None and set(plain) != set(expected):
        raise ProtocolError(f"{where} are {sorted(plain)}, this rank expects {sorted(expected)}")
    commit_id = plain.get("commit_id", 0)
    if type(commit_id) is not int or commit_id < 0:
        raise ProtocolError(f"{where}: commit_id {commit_id!r} is not a whole number")
    return plain


def _unique_keys(pairs: list[tuple[str, JsonValue]]) -> dict[str, JsonValue]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("a key appears twice in one object")
    return value


# -- the host-update vote ----------------------------------------------------------------------

#: Horovod's HostUpdateResult bits (horovod.runner.elastic.worker; a pure module may not import
#: Horovod): a notification says hosts were removed, added, or both.
REMOVED: Final = 1
ADDED: Final = 2
#: Seconds between two host-update votes the ranks aim for (the default of
#: ``ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL``; 0: a vote at every commit, as Horovod does). A
#: membership change then waits for up to this much more training; a failure does not wait.
VOTE_INTERVAL: Final = 0.5
#: The most commits between two votes.
MOST_COMMITS_PER_VOTE: Final = 100


@dataclass(frozen=True)
class VoteClock:
    """Which commits hold the host-update vote, counted from the ring's last state sync.

    Every rank commits at the same points and restarts the count at every sync, so the count
    is the same on every rank; each vote agrees on the commit of the next one (the fewest
    commits any rank asked for: :meth:`asks`). Between votes a commit is local.
    """

    #: Commits since the last sync.
    commits: int = 0
    #: The commit (by that count) that holds the next vote.
    due: int = 1
    #: This rank's clock (seconds) at the last vote, and the count then (None: no vote yet).
    voted_at: float | None = None
    voted_commits: int = 0

    def commit(self) -> tuple[VoteClock, bool]:
        """Count a commit: the new clock, and whether this commit votes."""
        counted = VoteClock(self.commits + 1, self.due, self.voted_at, self.voted_commits)
        return counted, counted.commits >= counted.due

    def asks(self, now: float, interval: float) -> int:
        """How many commits after this vote this rank asks the next one to be: as many as fit
        in ``interval`` seconds at its pace since the last vote (1 before the first vote or
        with ``interval`` 0)."""
        if self.voted_at is None or interval <= 0 or self.commits <= self.voted_commits:
            return 1
        per_commit = (now - self.voted_at) / (self.commits - self.voted_commits)
        if per_commit <= 0:
            return MOST_COMMITS_PER_VOTE
        return max(1, min(MOST_COMMITS_PER_VOTE, int(interval / per_commit)))

    def voted(self, now: float, next_in: int) -> VoteClock:
        """After the vote at this commit: the next one ``next_in`` commits later."""
        return VoteClock(self.commits, self.commits + max(1, next_in), now, self.commits)


@dataclass(frozen=True)
class HostUpdateVote:
    """One rank's part of the host-update check at a commit, sent as six integers.

    Horovod's ``State.check_host_updates`` drains the rank's notifications, then broadcasts rank
    0's ``(previous timestamp, newest timestamp, update bits)`` as a pickle; rank 0's view wins
    and the others' notifications are dropped. Here every rank sends its view, a Max allreduce
    combines them, and :func:`decide` reads the same verdict on every rank.
    """

    #: The newest notification this rank has acted on (Horovod's ``_last_updated_timestamp``).
    seen: int
    #: The newest timestamp among its new notifications, else ``seen``.
    newest: int
    #: The timestamp of the newest notification that announced removed hosts (0: none).
    removed: int = 0
    #: The timestamp of the newest notification that announced added hosts (0: none).
    added: int = 0
    #: ``size - rank`` when this rank's committed attributes are not plain data, else 0 (the
    #: Max then names the lowest such rank).
    refused: int = 0
    #: Commits until the next vote that this rank asks for (sent negated: the Max is then the
    #: fewest any rank asked for).
    next_in: int = 1

    @classmethod
    def drain(
        cls,
        seen: int,
        notifications: Iterable[tuple[int, int]],
        *,
        refused: int = 0,
        next_in: int = 1,
    ) -> HostUpdateVote:
        """The vote after the notifications ``(timestamp, update bits)`` in arrival order, with
        Horovod's filter: one counts only if it is newer than every one before it."""
        newest, removed, added = seen, 0, 0
        for timestamp, update in notifications:
            if timestamp > newest:
                newest = timestamp
                if update & REMOVED:
                    removed = timestamp
                if update & ADDED:
                    added = timestamp
        return cls(seen, newest, removed, added, refused, next_in)

    def vector(self) -> list[int]:
        """The six integers that the allreduce combines (by Max, element-wise)."""
        return [self.seen, self.newest, self.removed, self.added, self.refused, -self.next_in]


@dataclass(frozen=True)
class HostUpdateVerdict:
    """What every rank does after the vote: the same on every rank."""

    #: Every rank's new ``_last_updated_timestamp``.
    timestamp: int
    #: Raise HostsUpdatedInterrupt: some rank saw a notification newer than any rank had seen.
    interrupt: bool
    #: Its ``skip_sync``: every new notification announced only removals (Horovod's rule).
    skip_sync: bool
    #: The lowest rank whose committed attributes are not plain data (all raise), else None.
    refused_rank: int | None
    #: Commits until the next vote (the fewest any rank asked for).
    next_in: int = 1


def decide(reduced: Sequence[int], size: int) -> HostUpdateVerdict:
    """The verdict from the element-wise Max of every rank's :meth:`HostUpdateVote.vector`.

    A notification is new when it is newer than the newest one any rank has acted on; the kinds
    of the new ones decide ``skip_sync`` as Horovod's ``all_update == removed`` does.
    """
    if len(reduced) != 6:
        raise ProtocolError(f"host-update vote: expected 6 integers, got {len(reduced)}")
    seen, newest, removed, added, refused, negated_next = (int(v) for v in reduced)
    interrupt = newest > seen
    only_removed = removed > seen and added <= seen
    refused_rank = max(size - refused, 0) if refused > 0 else None
    next_in = max(1, min(MOST_COMMITS_PER_VOTE, -negated_next))
    return HostUpdateVerdict(
        max(seen, newest), interrupt, interrupt and only_removed, refused_rank, next_in
    )
