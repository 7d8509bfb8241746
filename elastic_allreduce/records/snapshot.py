"""A whole job read back from the store as one immutable, typed snapshot.

:func:`parse_job` turns the key-values under a job's prefix (a store listing, or a watch-fed
cache) into a :class:`JobSnapshot`: one typed record per key, with the key's revisions. Keys
that fit no shape of :mod:`.keys` and values that do not parse are *skipped* and listed in
:attr:`JobSnapshot.skipped` with the reason -- junk in the store never stops a reader.
:func:`read_job` lists a live store, :func:`read_ring` reads its ring. Pure apart from those
reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import MalformedKeyError, MalformedValueError
from elastic_allreduce.records import keys
from elastic_allreduce.records.keys import JobKey, KeyKind
from elastic_allreduce.records.values import (
    Directive,
    ExitRecord,
    HangRecord,
    JobConfig,
    JobStatus,
    LeaderRecord,
    MemberRecord,
    ProcRecord,
    Progress,
    RanksRecord,
    Ring,
    ScaleTarget,
)

if TYPE_CHECKING:
    from elastic_allreduce.store.api import Store

_R = TypeVar("_R")


class StoredValue(Protocol):
    """What the snapshot needs of a stored key (``elastic_allreduce.store.KeyValue``)."""

    @property
    def key(self) -> str: ...
    @property
    def mod_revision(self) -> int: ...
    @property
    def create_revision(self) -> int: ...
    @property
    def lease(self) -> int | None: ...
    @property
    def malformed(self) -> str | None: ...
    @property
    def value(self) -> JsonValue: ...


@dataclass(frozen=True)
class Stored(Generic[_R]):
    """A record with its key's metadata."""

    key: str
    record: _R
    mod_revision: int
    create_revision: int
    lease: int | None


@dataclass(frozen=True)
class Skipped:
    """A key the snapshot left out, and why."""

    key: str
    mod_revision: int
    reason: str


@dataclass(frozen=True)
class JobSnapshot:
    """Every record of one job at one store revision."""

    revision: int
    leader: Stored[LeaderRecord] | None = None
    config: Stored[JobConfig] | None = None
    target: Stored[ScaleTarget] | None = None
    ring: Stored[Ring] | None = None
    status: Stored[JobStatus] | None = None
    progress: Stored[Progress] | None = None
    ranks: Stored[RanksRecord] | None = None
    hang: Stored[HangRecord] | None = None
    members: Mapping[str, Stored[MemberRecord]] = field(default_factory=dict)
    procs: Mapping[str, Stored[ProcRecord]] = field(default_factory=dict)
    #: Keyed by (slot, incarnation).
    exits: Mapping[tuple[str, int], Stored[ExitRecord]] = field(default_factory=dict)
    directives: Mapping[str, Stored[Directive]] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()

    @property
    def empty(self) -> bool:
        """No key of the job is there (an unknown job)."""
        return not (self.leader or self.config or self.target or self.ring or self.status) and not (
            self.progress or self.members or self.procs or self.exits or self.directives
        )


#: Each key kind with one key per job: its record's parser and the JobSnapshot field it fills.
_SINGLE: Final[Mapping[KeyKind, tuple[str, Callable[[str, JsonValue], object]]]] = {
    KeyKind.LEADER: ("leader", LeaderRecord.from_json),
    KeyKind.JOB_CONFIG: ("config", JobConfig.from_json),
    KeyKind.SCALE_TARGET: ("target", ScaleTarget.from_json),
    KeyKind.RING: ("ring", Ring.from_json),
    KeyKind.JOB_STATUS: ("status", JobStatus.from_json),
    KeyKind.PROGRESS: ("progress", Progress.from_json),
    KeyKind.RANKS: ("ranks", RanksRecord.from_json),
    KeyKind.HANG: ("hang", HangRecord.from_json),
}


def _exit_index(key: JobKey) -> tuple[str, int] | None:
    return (key.slot, key.incarnation) if key.slot and key.incarnation else None


#: Each key kind of a family (``members/<node>``, ...): its parser, the JobSnapshot field it
#: fills, and the entry's index there (from the key's parts; None: the key is not indexed).
_FAMILIES: Final[
    Mapping[KeyKind, tuple[str, Callable[[str, JsonValue], object], Callable[[JobKey], object]]]
] = {
    KeyKind.MEMBER: ("members", MemberRecord.from_json, lambda key: key.node),
    KeyKind.PROC: ("procs", ProcRecord.from_json, lambda key: key.slot),
    KeyKind.EXIT: ("exits", ExitRecord.from_json, _exit_index),
    KeyKind.DIRECTIVE: ("directives", Directive.from_json, lambda key: key.node),
}


def parse_job(items: Iterable[StoredValue], revision: int) -> JobSnapshot:
    """The typed snapshot of these key-values (see the module docstring)."""
    #: JobSnapshot's fields by name (typed by the tables: a record of each field's own kind).
    fields: dict[str, Any] = {name: {} for name, _, _ in _FAMILIES.values()}
    skipped: list[Skipped] = []
    for kv in items:
        try:
            job_key = keys.parse(kv.key)
            if kv.malformed is not None:
                raise MalformedValueError(kv.key, kv.malformed)
            if job_key.kind in _SINGLE:
                name, parse = _SINGLE[job_key.kind]
                fields[name] = _stored(kv, parse(kv.key, kv.value))
            elif job_key.kind in _FAMILIES:
                name, parse, index = _FAMILIES[job_key.kind]
                where = index(job_key)
                if where is not None:
                    fields[name][where] = _stored(kv, parse(kv.key, kv.value))
        except (MalformedKeyError, MalformedValueError) as exc:
            skipped.append(Skipped(kv.key, kv.mod_revision, exc.reason))
    return JobSnapshot(revision, **fields, skipped=tuple(skipped))


def _stored(kv: StoredValue, record: _R) -> Stored[_R]:
    return Stored(kv.key, record, kv.mod_revision, kv.create_revision, kv.lease)


def read_job(store: Store) -> JobSnapshot:
    """List the store's job prefix and parse it (one read, at one revision)."""
    snapshot = store.get_prefix("")
    return parse_job(snapshot, snapshot.revision)


def read_ring(store: Store) -> Ring | None:
    """The job's ring as the store holds it now (None: no ring yet). Raises
    MalformedValueError for a value that does not parse."""
    stored = store.get(keys.RING)
    return None if stored is None else Ring.from_json(stored.key, stored.value)


class SkipReporter:
    """Remembers which skipped keys were reported, so each junk value is logged once."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def new(self, snapshot: JobSnapshot) -> list[Skipped]:
        """The skipped keys of ``snapshot`` not reported before."""
        fresh = [s for s in snapshot.skipped if (s.key, s.mod_revision) not in self._seen]
        self._seen.update((s.key, s.mod_revision) for s in fresh)
        return fresh
