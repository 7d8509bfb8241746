"""The ring guard: when the launcher re-forms the ring after a failure while this process has
not yet asked for its new rank, it shuts down Gloo's connections of the failed epoch, so a
collective waiting on a peer that already gave up fails at once instead of after Gloo's
timeout (docs/architecture.md, "Stuck collectives")."""

from __future__ import annotations

import logging
import threading

from elastic_allreduce.bootstrap.follow import each_record
from elastic_allreduce.bootstrap.sockets import (
    GlooSockets,
    shutdown_sockets,
)
from elastic_allreduce.errors import ElasticAllreduceError
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import read_ring
from elastic_allreduce.records.values import (
    EpochCause,
    Ring,
    RingState,
)
from elastic_allreduce.store import EtcdStore, Watch

log = logging.getLogger("elastic_allreduce.bootstrap")


class RingGuard:
    """Watches the ring; unblocks this process's collectives when its epoch failed, by shutting
    down Gloo's connections of that epoch (only those: see :class:`GlooSockets`)."""

    def __init__(self, store: EtcdStore, slot: str, epoch: int, gloo: GlooSockets) -> None:
        self._store = store
        self._slot = slot
        self._epoch = epoch
        self._gloo = gloo
        self._stop = threading.Event()
        self._watch: Watch = store.watch_prefix(keys.RING)
        self._thread = threading.Thread(target=self._run, name=f"ring-guard-{slot}", daemon=True)
        self._handled = epoch

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        each_record(self._watch, self._stop, Ring.from_json, self._on_ring, "ring (ring guard)")

    def _on_ring(self, ring: Ring) -> None:
        if ring.state is RingState.RUNNING and self._slot in ring.slots:
            self._epoch = max(self._epoch, ring.epoch)
            return
        if (
            ring.state is RingState.FORMING
            and ring.cause is EpochCause.FAILURE
            and ring.epoch > max(self._epoch, self._handled)
            and self._slot in ring.waiting
        ):
            self._handled = ring.epoch
            if not self._still_waiting(ring.epoch):
                log.info(
                    "slot %s: epoch %d failed; this process has already left epoch %d "
                    "(nothing to shut down)",
                    self._slot,
                    ring.epoch,
                    self._epoch,
                )
                return
            descriptors, others = self._gloo.established()
            count = shutdown_sockets(descriptors)
            log.info(
                "slot %s: epoch %d failed; shut down %d Gloo connections of epoch %d "
                "(kept %d other TCP connections)",
                self._slot,
                ring.epoch,
                count,
                self._epoch,
                others,
            )

    def _still_waiting(self, epoch: int) -> bool:
        """Whether the stored ring still waits for this slot in a failure epoch >= ``epoch``.
        An event can arrive late: once the slot asked for its rank, its next ``hvd.init()`` may
        already have connected a newer epoch, whose connections must stay. Unknown (the store
        does not answer): True, as the event says."""
        try:
            current = read_ring(self._store)
        except ElasticAllreduceError as exc:
            log.warning("slot %s: ring guard could not re-read the ring: %s", self._slot, exc)
            return True
        return current is None or (
            current.epoch >= epoch
            and current.state is RingState.FORMING
            and current.cause is EpochCause.FAILURE
            and self._slot in current.waiting
        )

    def stop(self) -> None:
        self._stop.set()
        self._watch.close()
