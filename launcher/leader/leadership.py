"""A launcher's leadership of its job: the leader key under its lease, standing by while
another launcher leads, taking a job over from a dead one, leading again under a new lease
after an outage let the old one lapse, and the guard on every leader's write.

A launcher leads while ``launcher/leader`` is under its lease. Every write it makes to the job
goes through :meth:`Leadership.write`, guarded by that key: after an etcd outage that let the
lease expire the launcher leads again first (the key re-created under a new lease, the
directives stamped anew), and if another launcher holds the key by then this one stops without
writing anything (:class:`LeadershipLostError`). The job loop (:mod:`launcher.leader.job`) owns
everything else.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import (
    ConfigError,
    ElasticAllreduceError,
    LeaseLostError,
    MalformedValueError,
    StoreError,
)
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import parse_job
from elastic_allreduce.records.values import Directive, JobPhase, JobStatus, LeaderRecord
from elastic_allreduce.rendezvous.protocol import split_host_port
from elastic_allreduce.store import EtcdStore, EventType, Guard, KeyValue, Lease

#: Seconds a `run` that finds another launcher leading gives its rendezvous to answer a connect.
DEAD_LEADER_PROBE: Final = 2.0
#: New leases a launcher that leads again tries in a row when etcd lets each lapse at once.
REGRANT_TRIES: Final = 3


class LeadershipLostError(ElasticAllreduceError):
    """Another launcher leads the job now: this one stopped acting (it writes nothing)."""


class OutageHold:
    """Member and process records that vanished right after an etcd outage, held back.

    A record is a node or process that lived through the outage until its holder registered
    again or the hold ends; the same holder (same pid) keeps its first registration revision,
    so the policy's order of members does not change. Pure bookkeeping on the loop's thread.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.until = 0.0
        self._last: dict[str, KeyValue] = {}
        self._first_revision: dict[tuple[str, int | None], int] = {}

    def outage(self, now: float) -> None:
        """The store was (or is) away: hold records until ``seconds`` from now."""
        self.until = max(self.until, now + self.seconds)

    def items(self, current: dict[str, KeyValue], now: float) -> dict[str, KeyValue]:
        """``current`` plus, while holding, the records it lost since the last call."""
        if now < self.until:
            for key, kv in self._last.items():
                if key not in current and key.startswith((keys.MEMBERS, keys.PROCS)):
                    current[key] = kv
        self._last = current
        return current

    def registered(self, key: str, pid: int | None, create_revision: int) -> int:
        """The revision a holder first registered ``key`` at (kept across re-registrations)."""
        return self._first_revision.setdefault((key, pid), create_revision)


@dataclass(frozen=True)
class Ended:
    """The job ended before this launcher led it (a standby saw its result)."""

    succeeded: bool
    reason: str


class Leadership:
    """One launcher's leadership of one job (see the module docstring). ``hold`` holds back
    the loop's decisions about vanished records after an outage; ``log`` says what happened."""

    def __init__(
        self,
        store: EtcdStore,
        job_id: str,
        lease_ttl: int,
        hold: OutageHold,
        log: Callable[[str], None],
        *,
        standby: bool = False,
    ) -> None:
        self.store = store
        self.job_id = job_id
        #: The TTL of the leases it takes (the job's --lease-ttl; an adopted job's own).
        self.lease_ttl = lease_ttl
        self.hold = hold
        self._log = log
        #: Wait while another launcher leads the job, then take it over (``--standby``).
        self.standby = standby
        #: The lease the leader key is under (None: it lost the job).
        self.lease: Lease | None = None
        #: What the leader key says: the rendezvous, the dashboard, the token.
        self.record = LeaderRecord(None)

    def grant(self) -> Lease:
        """The lease this launcher tries to lead under."""
        lease = self.lease = self.store.grant_lease(self.lease_ttl)
        return lease

    def become(self, lease: Lease) -> Ended | None:
        """Create ``launcher/leader`` under ``lease``. A standby waits while another launcher
        holds it and returns the job's result if the job ends meanwhile; otherwise a live
        leader is one clear ConfigError."""
        while True:
            try:
                if lease.lost:
                    # Its keep-alive stopped when etcd said it expired: never lead under it,
                    # even if etcd still holds it for a moment (seen after a quorum loss).
                    raise LeaseLostError(f"lease {lease.id:x} was reported expired")
                created = self.store.create(keys.LEADER, LeaderRecord(None).to_json(), lease=lease)
            except LeaseLostError:
                # A standby's own lease lapsed while it waited (etcd away past its TTL): it
                # takes the job over under a new one.
                self._log("this launcher's lease lapsed while it stood by; granting a new one")
                lease.stop_keepalive()
                lease = self.lease = self.store.grant_lease(self.lease_ttl)
                continue
            if created is not None:
                phase, reason = self.stored_phase()
                if self.standby and phase is not None and phase.final:
                    # A standby (every launcher pod on Kubernetes) that finds the job ended
                    # reports its result: a pod restarted after success must not fail the Job.
                    return Ended(phase is JobPhase.SUCCEEDED, reason or phase.value)
                return None
            if not self.standby:
                if self._dead_leader_gone():
                    continue
                raise ConfigError(
                    f"job {self.job_id!r} already has a live launcher at "
                    f"{self.store.describe()}; use another --job-id, `elastic-run join` to add "
                    "a worker to it, or `elastic-run run --standby` to stand by as its next "
                    "launcher"
                )
            ended = self._stand_by()
            if ended is not None:
                return ended

    def _dead_leader_gone(self) -> bool:
        """Whether the leader key belongs to a launcher that is dead and the key is gone now:
        its rendezvous refuses connections, so its lease lapses within a TTL, which this waits
        out (a `run` started again at once after a SIGKILL adopts the job instead of being
        refused). A leader whose rendezvous answers, or that is not served yet, is alive."""
        dead = self._refusing_leader()
        if dead is None:
            return self.store.get(keys.LEADER) is None
        wait = 2 * self.lease_ttl + 2
        self._log(
            f"the job's launcher at {dead} is not answering; waiting up to {wait} s for its "
            "lease to lapse"
        )
        deadline = time.monotonic() + wait
        with self.store.watch_prefix(keys.LEADER) as watch:
            while self.store.get(keys.LEADER) is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                watch.get(min(remaining, 1.0))
        return True

    def _refusing_leader(self) -> str | None:
        """The rendezvous address of the stored leader if it refuses connections (nothing
        listens there: the launcher is gone), else None."""
        stored = self.store.get(keys.LEADER)
        endpoint = None
        if stored is not None:
            with contextlib.suppress(MalformedValueError):
                endpoint = LeaderRecord.from_json(stored.key, stored.value).endpoint()
        if endpoint is None:
            return None
        try:
            socket.create_connection(
                split_host_port(endpoint.address), timeout=DEAD_LEADER_PROBE
            ).close()
        except ConnectionRefusedError:
            return endpoint.address
        except OSError:
            pass  # unreachable from here, or slow: it may well be alive elsewhere
        return None

    def _stand_by(self) -> Ended | None:
        """Wait until the leader key is gone (then: None, try to lead) or the job ended (its
        result)."""
        self._log("standing by: another launcher leads the job; taking over when it is gone")
        with self.store.watch_prefix(keys.LEADER) as watch:
            while True:
                phase, reason = self.stored_phase()
                if phase is not None and phase.final:
                    self._log(f"the job {phase.value} while this launcher stood by: {reason}")
                    return Ended(phase is JobPhase.SUCCEEDED, reason or phase.value)
                if self.store.get(keys.LEADER) is None:
                    return None
                event = watch.get(1.0)
                if event is not None and event.type is not EventType.PUT:
                    return None

    def stored_phase(self) -> tuple[JobPhase | None, str | None]:
        status = self.store.get(keys.JOB_STATUS)
        if status is None or status.malformed is not None:
            return None, None
        with contextlib.suppress(MalformedValueError):
            record = JobStatus.from_json(status.key, status.value)
            return record.phase, record.reason
        return None, None

    def guard(self) -> Guard:
        """The condition of every leader's write: the leader key is still under this
        launcher's lease."""
        if self.lease is None:
            raise self.lost()
        return Guard(keys.LEADER, self.lease.id)

    def write(self, key: str, value: JsonValue | Callable[[], JsonValue]) -> None:
        """A leader's write: only while this launcher leads (LeadershipLostError if another
        launcher does; after an outage that let its lease expire, it leads again first). A
        callable value is rendered at each try: records stamped with the lease (:meth:`stamp`)
        get the new one after a reclaim."""
        render = value if callable(value) else lambda: value
        if self.store.put_guarded(key, render(), guard=self.guard()) is not None:
            return
        self.reclaim()
        if self.store.put_guarded(key, render(), guard=self.guard()) is None:
            raise self.lost()

    def stamp(self) -> int | None:
        """This launcher's lease, written into the records agents obey (status, directives)."""
        return None if self.lease is None else self.lease.id

    def restamp_directives(self) -> None:
        """Write the stored directives again under this launcher's lease (it adopted the job,
        or leads again under a new lease): agents follow only their current leader's."""
        job = parse_job(self.store.get_prefix(keys.DIRECTIVES).items, 0)
        for node, stored in job.directives.items():
            if stored.record.leader != self.stamp():
                self.write(keys.directive(node), self.directive(stored.record.incarnations))

    def directive(self, incarnations: tuple[tuple[int, int], ...]) -> Callable[[], JsonValue]:
        """A directive as :meth:`write` renders it: stamped with the lease it is written under."""
        return lambda: Directive(incarnations, self.stamp()).to_json()

    def reclaim(self) -> None:
        """A guarded write failed: lead again if the leader key is gone or still under this
        launcher's (expired) lease; LeadershipLostError if another launcher holds it."""
        lease = self.lease
        if lease is None:
            raise self.lost()
        self.lead_again(lease)

    def leads(self) -> bool:
        held = self.store.get(keys.LEADER)
        return held is not None and self.lease is not None and held.lease == self.lease.id

    def lost(self) -> LeadershipLostError:
        return LeadershipLostError(
            f"job {self.job_id}: this launcher no longer leads the job (its lease "
            "expired and another launcher took over); it stopped without writing anything"
        )

    def check(self) -> None:
        """After an etcd outage: hold back decisions about vanished records, and lead again
        under a new lease if etcd let this one expire (LeadershipLostError if another launcher
        took the job meanwhile)."""
        lease = self.lease
        assert lease is not None
        now = time.monotonic()
        if now > lease.safe_until:
            self.hold.outage(now)
        if lease.lost:
            self.lead_again(lease)

    def publish(self, lease: Lease) -> None:
        """Write the leader record (the rendezvous address and token) over the placeholder the
        leader key was created with, only while it is still under ``lease``: a lease that
        lapsed since (an etcd restart right after a takeover) is replaced as any other
        (:meth:`lead_again`), and a successor's key is never overwritten."""
        try:
            written = self.store.put_guarded(
                keys.LEADER,
                self.record.to_json(),
                guard=Guard(keys.LEADER, lease.id),
                lease=lease,
            )
        except LeaseLostError:
            written = None
        if written is None:
            self.lead_again(lease)

    def lead_again(self, lost: Lease) -> None:
        """This launcher's lease expired (an etcd outage, or a stop past its TTL): lead again
        under a new lease, unless another launcher holds the leader key by now."""
        held = self.store.get(keys.LEADER)
        if held is not None and held.lease != lost.id:
            self.lease = None
            lost.stop_keepalive()
            raise self.lost()
        # etcd reports an expired lease before it has deleted the lease's keys: revoke it
        # outright, so the leader key is gone unless another launcher took it meanwhile.
        lost.stop_keepalive()
        with contextlib.suppress(StoreError):
            self.store.revoke_lease(lost.id)
        for _ in range(REGRANT_TRIES):
            lease = self.lease = self.store.grant_lease(self.lease_ttl)
            try:
                created = self.store.create(keys.LEADER, self.record.to_json(), lease=lease)
            except LeaseLostError:
                # Gone between its grant and its use (etcd restarted meanwhile): another one.
                lease.stop_keepalive()
                continue
            if created is None:
                lease.revoke()
                self.lease = None
                raise self.lost()
            break
        else:
            self.lease = None
            raise LeaseLostError(
                f"job {self.job_id}: etcd let {REGRANT_TRIES} new leases of this "
                "launcher lapse before it could lead under one"
            )
        self.hold.outage(time.monotonic())
        self.restamp_directives()
        self._log(
            "etcd let this launcher's lease expire while it was away; leading again under a "
            "new lease (holding back decisions about vanished members for "
            f"{self.hold.seconds:.0f} s)"
        )
