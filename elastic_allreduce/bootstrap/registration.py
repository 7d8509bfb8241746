"""A training process's ``procs/<slot>`` record under its node's lease, which the agent keeps
alive: a process busy for seconds (TensorFlow's import, a trace holding the GIL) cannot lose it."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Final

from elastic_allreduce.errors import LeaseLostError
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import ProcRecord
from elastic_allreduce.store import EtcdStore, LeaseRef

log = logging.getLogger("elastic_allreduce.bootstrap")

#: Seconds a write waits for the agent to register the node again under a new lease (after
#: etcd let the old one expire in an outage), at least; the job's outage timeout if longer.
NODE_REGISTER_WAIT: Final = 60.0


class Registration:
    """This process's ``procs/<slot>`` record, under the lease of its node.

    One lease per node, kept alive by its agent, which judges its processes' liveness from what
    it sees: an exit (it reports it and deletes the record), a stopped process (killed); the
    launcher's stuck and hang watchdogs find a process that runs but hangs. A dead or cut-off
    node's lease takes its processes' records with it.

    When etcd let the node's lease expire in an outage, the agent registers the node again under
    a new lease and writes its live processes' records again; a later write of this process
    under the old lease fails, and goes again under the lease the node's record is under now
    (waiting for the agent to register the node again, if it has not yet).
    """

    def __init__(self, store: EtcdStore, slot: str, record: ProcRecord, node_lease: int) -> None:
        self._store = store
        self._key = keys.proc(slot)
        self._member_key = keys.member(keys.split_slot(slot)[0])
        self._lock = threading.Lock()
        self.lease = LeaseRef(node_lease)
        self.record = replace(record, lease=node_lease)
        with self._lock:
            self._write()

    def update(self, record: ProcRecord) -> None:
        """Write a new version of the record (phase, epoch) under the node's lease."""
        with self._lock:
            self.record = replace(record, lease=self.lease.id)
            self._write()

    def _write(self) -> None:
        try:
            self._store.put(self._key, self.record.to_json(), lease=self.lease)
        except LeaseLostError:
            self._write_under_new_lease()

    def _write_under_new_lease(self) -> None:
        """The node's lease is gone: write under the one its record is under now, once the
        agent has registered the node again; LeaseLostError if it did not in time."""
        wait = max(NODE_REGISTER_WAIT, self._store.outage_timeout)
        deadline = time.monotonic() + wait
        lost = self.lease.id
        with self._store.watch_prefix(self._member_key) as watch:
            while True:
                member = self._store.get(self._member_key)
                if member is not None and member.lease is not None and member.lease != lost:
                    self.lease = LeaseRef(member.lease)
                    self.record = replace(self.record, lease=member.lease)
                    try:
                        self._store.put(self._key, self.record.to_json(), lease=self.lease)
                    except LeaseLostError:
                        lost = member.lease  # lost again meanwhile: wait for the next one
                    else:
                        log.info(
                            "%s: written under the node's new lease %x (etcd let lease %x "
                            "expire while it was away)",
                            self._key,
                            member.lease,
                            lost,
                        )
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LeaseLostError(
                        f"{self._key}: the node's lease is gone and its agent did not register "
                        f"the node again within {wait:.0f} s"
                    )
                watch.get(timeout=remaining)
