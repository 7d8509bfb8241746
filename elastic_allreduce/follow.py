"""A training process follows the job's launcher to a new address.

When a standby or a restarted launcher takes a job over, it serves the rendezvous at its own
address and writes that into ``launcher/leader``. The ranks go on training meanwhile: they need
no launcher to step, only to change members. :class:`LeaderFollower` watches the record and,
when the address changes,

- points Horovod at it: ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT`` in the environment, which
  the next ``hvd.init()`` (at a reset) reads -- for an IPv6 launcher they name this process's
  relay, which is re-pointed instead (:class:`elastic_allreduce.ipv6.HorovodRendezvous`);
- moves the progress beacon to it (:attr:`LeaderFollower.address` is what the beacon reads);
- registers the process's notification service with it again. Horovod registers that service
  once, with the first launcher (``WorkerNotificationManager.init``); without it a new launcher
  could not tell the ranks that the ring grows. :func:`capture_registration` keeps what Horovod
  sent, so the same registration can be sent to the new address.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ElasticAllreduceError, StoreError
from elastic_allreduce.ipv6 import HorovodRendezvous
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import LeaderRecord
from elastic_allreduce.store import EventType, Store, Watch

log = logging.getLogger(__name__)
_R = TypeVar("_R")

#: What Horovod's worker sent to the first launcher: (key, value) of its worker_addresses PUT.
_registration: tuple[str, Any] | None = None
_registration_lock = threading.Lock()
_send: Callable[..., None] | None = None


def capture_registration() -> None:
    """Keep the notification service's registration when Horovod sends it (idempotent)."""
    global _send  # noqa: PLW0603 - one patch of Horovod's module, once per process
    from horovod.runner.elastic import worker  # noqa: PLC0415 - Horovod loads late
    from horovod.runner.elastic.rendezvous import PUT_WORKER_ADDRESSES  # noqa: PLC0415

    if _send is not None:
        return
    send: Callable[..., None] = worker.put_data_into_kvstore
    _send = send

    def put(addr: str, port: int, scope: str, key: str, value: Any) -> None:  # noqa: ANN401
        global _registration  # noqa: PLW0603
        if scope == PUT_WORKER_ADDRESSES:
            with _registration_lock:
                _registration = (key, value)
        send(addr, port, scope, key, value)

    worker.put_data_into_kvstore = put


def register_again(host: str, port: int) -> bool:
    """Send the kept registration to the launcher's rendezvous at ``host:port`` as Horovod
    reaches it (its relay for an IPv6 launcher: Horovod's client puts no brackets around an
    IPv6 address); whether one was sent."""
    from horovod.runner.elastic.rendezvous import PUT_WORKER_ADDRESSES  # noqa: PLC0415

    with _registration_lock:
        registration = _registration
    if registration is None or _send is None:
        return False
    _send(host, port, PUT_WORKER_ADDRESSES, *registration)
    return True


def each_record(
    watch: Watch,
    stop: threading.Event,
    parse: Callable[[str, JsonValue], _R],
    handle: Callable[[_R], None],
    what: str,
) -> None:
    """Hand every record written under ``watch`` to ``handle`` until ``stop`` is set or the
    watch gives up; a malformed value is logged and skipped (a stray value never stops it)."""
    while not stop.is_set():
        try:
            event = watch.get(1.0)
        except StoreError as exc:
            log.warning("stopped watching the %s: %s", what, exc)
            return
        if event is None or event.type is not EventType.PUT or event.kv is None:
            continue
        try:
            record = parse(event.key, event.kv.value)
        except ElasticAllreduceError as exc:
            log.warning("ignoring a malformed %s: %s", what, exc)
            continue
        handle(record)


class LeaderFollower:
    """Watches ``launcher/leader`` and follows its rendezvous address (module docstring)."""

    def __init__(
        self, store: Store, slot: str, address: str, horovod: HorovodRendezvous | None = None
    ) -> None:
        self._slot = slot
        #: Points Horovod's own clients at the launcher (directly, or through a relay).
        self._horovod = horovod or HorovodRendezvous()
        self._lock = threading.Lock()
        self._address = address
        self._stop = threading.Event()
        self._watch: Watch = store.watch_prefix(keys.LEADER)
        self._thread = threading.Thread(target=self._run, name=f"follow-{slot}", daemon=True)

    def address(self) -> str:
        """The launcher's rendezvous address as this process knows it now."""
        with self._lock:
            return self._address

    def start(self, store: Store | None = None) -> None:
        """Start following (with ``store``: from the leader record as it is now)."""
        if store is not None:
            current = store.get(keys.LEADER)
            with contextlib.suppress(ElasticAllreduceError):
                if current is not None:
                    moved = LeaderRecord.from_json(current.key, current.value).rendezvous
                    if moved is not None:
                        self.follow(moved)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._watch.close()

    def _run(self) -> None:
        each_record(
            self._watch, self._stop, LeaderRecord.from_json, self._on_leader, "leader record"
        )

    def _on_leader(self, record: LeaderRecord) -> None:
        if record.rendezvous is not None:
            self.follow(record.rendezvous)

    def follow(self, address: str) -> None:
        """Point Horovod, the beacon and the notification service at ``address``."""
        with self._lock:
            if address == self._address:
                return
            self._address = address
        try:
            host, port = self._horovod.point(address)
            registered = register_again(host, port)
        except (OSError, RuntimeError, ElasticAllreduceError) as exc:
            log.warning("slot %s: could not register with the new launcher: %s", self._slot, exc)
            registered = False
        log.info(
            "slot %s: the job's launcher moved to %s%s",
            self._slot,
            address,
            "; registered with it" if registered else "",
        )
