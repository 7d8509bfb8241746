"""A training process's ``procs/<slot>`` record under a lease of its own, registered again when
etcd let the lease expire (an outage, a keep-alive too late)."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from elastic_allreduce.errors import StoreError
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import ProcRecord
from elastic_allreduce.store import EtcdStore, Lease

log = logging.getLogger("elastic_allreduce.bootstrap")


class Registration:
    """This process's ``procs/<slot>`` record, under a lease of its own.

    etcd lets every lease expire when it was unreachable for longer than the TTL (a stopped or
    stalled etcd revokes them as soon as it runs again), although this process lived on. So a
    lease reported lost is replaced and the record written again under the new one: the
    launcher, which holds back its decisions about vanished records for a while after such an
    outage, sees the same process again and the rank keeps training. A lease that lapsed
    without an outage (a keep-alive too late on a loaded machine) is replaced the same way,
    which spares a process not yet in a ring its restart (``RingPolicy._settle_lost_leases``).
    A process that really died writes nothing, and its record stays gone.
    """

    def __init__(self, store: EtcdStore, slot: str, record: ProcRecord, ttl: int) -> None:
        self._store = store
        self._key = keys.proc(slot)
        self._ttl = ttl
        self._lock = threading.Lock()
        self.lease = store.grant_lease(ttl, on_lost=self._on_lost)
        self.record = replace(record, lease=self.lease.id)
        store.put(self._key, self.record.to_json(), lease=self.lease)

    def update(self, record: ProcRecord) -> None:
        """Write a new version of the record (phase, epoch) under the current lease."""
        with self._lock:
            self.record = replace(record, lease=self.lease.id)
            self._store.put(self._key, self.record.to_json(), lease=self.lease)

    def _on_lost(self, lost: Lease) -> None:
        # On the lost lease's keep-alive thread, which ends after this returns.
        with self._lock:
            if lost is not self.lease:
                return
            try:
                self.lease = self._store.grant_lease(self._ttl, on_lost=self._on_lost)
                self.record = replace(self.record, lease=self.lease.id)
                self._store.put(self._key, self.record.to_json(), lease=self.lease)
            except StoreError as exc:
                log.warning(
                    "%s: could not register again after losing its lease: %s", self._key, exc
                )
                return
        log.info("%s: lease %x expired while etcd was away; registered again", self._key, lost.id)
