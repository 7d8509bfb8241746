"""The membership store: an abstract, job-scoped key-value store with leases, CAS and watches.

The store is the job's source of truth (launcher leadership, members, ring epochs, status).
Every implementation must keep these semantics; ``tests/store/test_contract.py`` pins them
down and runs against each implementation.

Keys
    Callers use *relative* keys such as ``"members/node-1"``. A store is bound to one job and
    maps them under ``<root>/<job-id>/``, so two jobs never see each other's keys.

Values
    JSON, wrapped in an envelope that carries a schema version (see :mod:`.codec`). A value
    that is not valid JSON in that envelope never raises while listing or watching: the
    :class:`KeyValue` records why in :attr:`KeyValue.malformed` and a warning is logged;
    reading :attr:`KeyValue.value` raises :class:`~elastic_allreduce.errors.MalformedValueError`.

Revisions and atomicity
    Every write returns the store revision it created. Reads return immutable snapshots that
    carry the revision they were read at and each key's ``mod_revision``.
    :meth:`Store.compare_and_swap` succeeds only when the key's current ``mod_revision`` equals
    the expected one (``0`` means "absent"); it is atomic on the server.

Leases
    A lease is granted with a TTL in whole seconds and kept alive by one background thread owned
    by the :class:`Lease`. Keys written under a lease vanish when it expires or is revoked.
    Liveness is decided by the server's TTL, never by comparing clocks. A key may also be
    written under a lease another process keeps alive (:class:`LeaseRef`: a training process's
    record under its node's lease); the write fails with LeaseLostError once that lease is gone.

Watches
    :meth:`Store.watch_prefix` delivers every change under a prefix, in revision order, from a
    start revision. It survives server restarts (reconnects and resumes after the last
    delivered revision). When the history it needs was compacted it re-lists the prefix and
    delivers one :attr:`EventType.RESYNC` event that carries the full current snapshot. It never
    stops silently: when no endpoint answers for longer than its give-up time, the next
    :meth:`Watch.get` raises :class:`~elastic_allreduce.errors.StoreUnavailableError`.

Deadlines
    Calls wait out an unreachable store up to the implementation's outage limit. A caller with
    a deadline of its own (an agent must be back in time to check its lease) makes its calls
    inside :meth:`Store.give_up_at`: they then raise StoreUnavailableError at that moment
    instead, each attempt also cut short to fit. The deadline is the calling thread's only.

Errors
    Unreachable endpoints raise :class:`~elastic_allreduce.errors.StoreUnavailableError`; other
    server-side failures raise :class:`~elastic_allreduce.errors.StoreError`. A write whose reply
    was lost (connection dropped after sending) may be retried on another endpoint and then be
    reported as a CAS conflict; callers re-read after a conflict, so they see their own value.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final

from elastic_allreduce import codec
from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ConfigError, MalformedValueError
from elastic_allreduce.records.keys import validate_job_id

DEFAULT_ROOT: Final = "/elastic-allreduce"
_KEY_RE: Final = re.compile(r"^[A-Za-z0-9_.:@=+-]+(/[A-Za-z0-9_.:@=+-]+)*/?$")


def validate_key(key: str, *, allow_empty: bool = False) -> str:
    """Return a relative key (or prefix) if it is well formed, else raise ConfigError."""
    if key == "" and allow_empty:
        return key
    if not _KEY_RE.match(key) or any(part in (".", "..") for part in key.split("/")):
        raise ConfigError(
            f"invalid store key {key!r}: use '/'-separated segments of letters, digits and "
            "'_.:@=+-', without a leading '/' (for example 'members/node-1')"
        )
    return key


@dataclass(frozen=True)
class KeyValue:
    """One key as read at some revision. Immutable; :attr:`value` decodes a fresh copy."""

    key: str
    raw: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int | None
    malformed: str | None

    @classmethod
    def decode(
        cls,
        key: str,
        raw: bytes,
        *,
        mod_revision: int,
        create_revision: int,
        version: int,
        lease: int | None,
    ) -> KeyValue:
        """Build a KeyValue, recording (not raising) why ``raw`` is malformed, if it is."""
        try:
            codec.decode(key, raw)
            malformed = None
        except MalformedValueError as exc:
            malformed = exc.reason
        return cls(key, raw, mod_revision, create_revision, version, lease, malformed)

    @property
    def value(self) -> JsonValue:
        """The decoded payload; raises MalformedValueError when the stored bytes are malformed."""
        return codec.decode(self.key, self.raw)


@dataclass(frozen=True)
class Snapshot:
    """The keys under a prefix at one store revision, sorted by key."""

    revision: int
    items: tuple[KeyValue, ...]

    def __iter__(self) -> Iterator[KeyValue]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def as_dict(self) -> Mapping[str, KeyValue]:
        """The items keyed by their relative key."""
        return {kv.key: kv for kv in self.items}

    def get(self, key: str) -> KeyValue | None:
        """The item with this relative key, or None."""
        return self.as_dict().get(key)


class EventType(enum.Enum):
    """Kinds of watch events."""

    PUT = "PUT"
    DELETE = "DELETE"
    #: The history the watch needed was compacted: ``snapshot`` replaces the watcher's state.
    RESYNC = "RESYNC"


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix.

    PUT carries ``kv``; DELETE carries only ``key``; RESYNC carries ``snapshot`` (and ``key`` is
    the watched prefix). ``revision`` is the store revision of the change (of the re-list for
    RESYNC).
    """

    type: EventType
    key: str
    revision: int
    kv: KeyValue | None = None
    snapshot: Snapshot | None = None


class Lease(abc.ABC):
    """A server-side TTL that keys can be attached to, kept alive by one owned thread."""

    #: Server-assigned lease id.
    id: int
    #: TTL in seconds as granted by the server (it may raise a too-small request).
    ttl: int

    def __init__(self) -> None:
        self._lost = threading.Event()
        #: ``time.monotonic()`` when the request of the last renewal the server granted (or of
        #: the grant) was sent: the server's TTL ran from a moment after it.
        self.renewed_at = time.monotonic()

    @property
    def lost(self) -> bool:
        """True once the server reported the lease gone (expired or revoked)."""
        return self._lost.is_set()

    @property
    def safe_until(self) -> float:
        """``time.monotonic()`` until which the lease surely still exists on the server (the
        last granted renewal's TTL, counted from before it was sent): after it, a holder cut
        off from the server cannot know whether its keys are gone and the others moved on."""
        return self.renewed_at + self.ttl

    def wait_lost(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the lease to be lost; return whether it was."""
        return self._lost.wait(timeout)

    @abc.abstractmethod
    def stop_keepalive(self) -> None:
        """Stop refreshing without revoking: the keys expire after the TTL (like a crash)."""

    @abc.abstractmethod
    def revoke(self) -> None:
        """Stop refreshing and revoke now: the lease's keys are deleted at once. Idempotent."""

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.revoke()


@dataclass(frozen=True)
class LeaseRef:
    """A lease kept alive by another process (a node's, by its agent): keys may be written
    under it, but this holder neither renews nor revokes it."""

    id: int


class Watch(abc.ABC):
    """A stream of :class:`WatchEvent` under one prefix, in revision order."""

    @abc.abstractmethod
    def get(self, timeout: float) -> WatchEvent | None:
        """The next event, or None when none arrives within ``timeout`` seconds.

        Raises StoreUnavailableError when the watch gave up reconnecting, and WatchClosedError
        after :meth:`close`.
        """

    @property
    @abc.abstractmethod
    def revision(self) -> int:
        """The revision up to which events have been delivered by :meth:`get`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the watch and join its thread. Idempotent."""

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Store(abc.ABC):
    """A job-scoped membership store (see the module docstring for the contract)."""

    def __init__(self, job_id: str, root: str = DEFAULT_ROOT) -> None:
        self.job_id = validate_job_id(job_id)
        if not root.startswith("/") or root.endswith("/"):
            raise ConfigError(f"invalid store root {root!r}: it must start and not end with '/'")
        self.root = root
        #: Absolute prefix of this job's keys; ends with '/', so 'job1' never matches 'job10'.
        self.prefix = f"{root}/{job_id}/"
        self._deadlines = threading.local()

    @contextlib.contextmanager
    def give_up_at(self, deadline: float) -> Iterator[None]:
        """Inside: this thread's calls give up at ``deadline`` (``time.monotonic()``) with
        StoreUnavailableError rather than wait out an outage past it (nested: the earlier)."""
        outer: float | None = getattr(self._deadlines, "at", None)
        self._deadlines.at = deadline if outer is None else min(outer, deadline)
        try:
            yield
        finally:
            self._deadlines.at = outer

    def caller_deadline(self) -> float | None:
        """The deadline this thread's calls give up at (:meth:`give_up_at`); None: none."""
        at: float | None = getattr(self._deadlines, "at", None)
        return at

    def absolute(self, key: str, *, allow_empty: bool = False) -> str:
        """The absolute key of a relative key (or prefix) in this job's scope."""
        return self.prefix + validate_key(key, allow_empty=allow_empty)

    def relative(self, absolute_key: str) -> str:
        """The relative key of an absolute key of this job."""
        if not absolute_key.startswith(self.prefix):
            raise ValueError(f"key {absolute_key!r} is outside job scope {self.prefix!r}")
        return absolute_key[len(self.prefix) :]

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the store lives, for messages (for example 'etcd at 127.0.0.1:2379')."""

    @abc.abstractmethod
    def check(self) -> str:
        """Contact the server and return its version; raises StoreUnavailableError."""

    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None:
        """The key's current value with its revisions, or None when absent."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str = "") -> Snapshot:
        """All keys under a relative prefix ('' = the whole job), at one revision."""

    @abc.abstractmethod
    def put(self, key: str, value: JsonValue, *, lease: Lease | LeaseRef | None = None) -> int:
        """Write unconditionally; return the new store revision."""

    @abc.abstractmethod
    def compare_and_swap(
        self,
        key: str,
        value: JsonValue,
        *,
        expected_mod_revision: int,
        lease: Lease | LeaseRef | None = None,
    ) -> int | None:
        """Write only if the key's mod_revision equals the expected one (0 = key absent).

        Returns the new revision, or None when the comparison failed (nothing was written).
        """

    def create(
        self, key: str, value: JsonValue, *, lease: Lease | LeaseRef | None = None
    ) -> int | None:
        """Write only if the key is absent; return the new revision or None if it exists."""
        return self.compare_and_swap(key, value, expected_mod_revision=0, lease=lease)

    @abc.abstractmethod
    def delete(self, key: str, *, expected_mod_revision: int | None = None) -> bool:
        """Delete a key (only at that mod_revision, if given); return whether it was deleted."""

    @abc.abstractmethod
    def grant_lease(self, ttl: int, *, on_lost: Callable[[Lease], None] | None = None) -> Lease:
        """Grant a lease of ``ttl`` seconds and start keeping it alive.

        ``on_lost`` runs once, on the keep-alive thread, when the server reports it gone.
        """

    @abc.abstractmethod
    def lease_remaining(self, lease_id: int) -> int | None:
        """Whole seconds the server still keeps ``lease_id``, or None when it is gone or has
        expired. Right after an outage etcd revokes every expired lease, one at a time: until
        it has, their keys are still there, and only this tells that they are dead."""

    @abc.abstractmethod
    def revoke_lease(self, lease_id: int) -> bool:
        """Revoke any lease by id (to evict a member that stopped responding).

        Its keys are deleted at once and its holder's keep-alive reports it lost. Returns False
        when the server does not know the lease (already expired or revoked).
        """

    @abc.abstractmethod
    def watch_prefix(
        self,
        prefix: str = "",
        *,
        start_revision: int | None = None,
        give_up_after: float | None = None,
    ) -> Watch:
        """Watch every change under a relative prefix from ``start_revision``.

        The watch reconnects for up to ``give_up_after`` seconds (None: the store's outage
        timeout, at least 60 s) before :meth:`Watch.get` raises StoreUnavailableError.

        Without ``start_revision`` the watch starts after the current revision. Pass
        ``snapshot.revision + 1`` to continue exactly where a :meth:`get_prefix` left off.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every lease keep-alive and watch this store started. Idempotent."""

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
