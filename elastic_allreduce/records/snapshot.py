"""A whole job read back from the store as one immutable, typed snapshot.

:func:`parse_job` turns the key-values under a job's prefix (a store listing, or a watch-fed
cache) into a :class:`JobSnapshot`: one typed record per key, with the key's revisions. Keys
that fit no shape of :mod:`.keys` and values that do not parse are *skipped* and listed in
:attr:`JobSnapshot.skipped` with the reason -- junk in the store never stops a reader.
:func:`read_job` lists a live store. Pure apart from that one read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import MalformedKeyError, MalformedValueError
from elastic_allreduce.records import keys
from elastic_allreduce.records.keys import KeyKind
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


def parse_job(items: Iterable[StoredValue], revision: int) -> JobSnapshot:  # noqa: PLR0912
    """The typed snapshot of these key-values (see the module docstring)."""
    leader: Stored[LeaderRecord] | None = None
    config: Stored[JobConfig] | None = None
    target: Stored[ScaleTarget] | None = None
    ring: Stored[Ring] | None = None
    status: Stored[JobStatus] | None = None
    progress: Stored[Progress] | None = None
    ranks: Stored[RanksRecord] | None = None
    hang: Stored[HangRecord] | None = None
    members: dict[str, Stored[MemberRecord]] = {}
    procs: dict[str, Stored[ProcRecord]] = {}
    exits: dict[tuple[str, int], Stored[ExitRecord]] = {}
    directives: dict[str, Stored[Directive]] = {}
    skipped: list[Skipped] = []
    for kv in items:
        try:
            job_key = keys.parse(kv.key)
            if kv.malformed is not None:
                raise MalformedValueError(kv.key, kv.malformed)
            kind, key, value = job_key.kind, kv.key, kv.value
            if kind is KeyKind.MEMBER and job_key.node is not None:
                members[job_key.node] = _stored(kv, MemberRecord.from_json(key, value))
            elif kind is KeyKind.PROC and job_key.slot is not None:
                procs[job_key.slot] = _stored(kv, ProcRecord.from_json(key, value))
            elif kind is KeyKind.EXIT and job_key.slot and job_key.incarnation:
                exit_key = (job_key.slot, job_key.incarnation)
                exits[exit_key] = _stored(kv, ExitRecord.from_json(key, value))
            elif kind is KeyKind.DIRECTIVE and job_key.node is not None:
                directives[job_key.node] = _stored(kv, Directive.from_json(key, value))
            elif kind is KeyKind.LEADER:
                leader = _stored(kv, LeaderRecord.from_json(key, value))
            elif kind is KeyKind.JOB_CONFIG:
                config = _stored(kv, JobConfig.from_json(key, value))
            elif kind is KeyKind.SCALE_TARGET:
                target = _stored(kv, ScaleTarget.from_json(key, value))
            elif kind is KeyKind.RING:
                ring = _stored(kv, Ring.from_json(key, value))
            elif kind is KeyKind.JOB_STATUS:
                status = _stored(kv, JobStatus.from_json(key, value))
            elif kind is KeyKind.PROGRESS:
                progress = _stored(kv, Progress.from_json(key, value))
            elif kind is KeyKind.RANKS:
                ranks = _stored(kv, RanksRecord.from_json(key, value))
            elif kind is KeyKind.HANG:
                hang = _stored(kv, HangRecord.from_json(key, value))
        except (MalformedKeyError, MalformedValueError) as exc:
            skipped.append(Skipped(kv.key, kv.mod_revision, exc.reason))
    return JobSnapshot(
        revision,
        leader,
        config,
        target,
        ring,
        status,
        progress,
        ranks,
        hang,
        members=members,
        procs=procs,
        exits=exits,
        directives=directives,
        skipped=tuple(skipped),
    )


def _stored(kv: StoredValue, record: _R) -> Stored[_R]:
    return Stored(kv.key, record, kv.mod_revision, kv.create_revision, kv.lease)


def read_job(store: Store) -> JobSnapshot:
    """List the store's job prefix and parse it (one read, at one revision)."""
    snapshot = store.get_prefix("")
    return parse_job(snapshot, snapshot.revision)


class SkipReporter:
    """Remembers which skipped keys were reported, so each junk value is logged once."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def new(self, snapshot: JobSnapshot) -> list[Skipped]:
        """The skipped keys of ``snapshot`` not reported before."""
        fresh = [s for s in snapshot.skipped if (s.key, s.mod_revision) not in self._seen]
        self._seen.update((s.key, s.mod_revision) for s in fresh)
        return fresh
