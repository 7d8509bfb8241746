"""A training process follows the job's launcher to a new address.

When a standby or a restarted launcher takes a job over, it serves the rendezvous at its own
address, with a token of its own, and writes both into ``launcher/leader``. The ranks go on
training meanwhile: they need no launcher to step, only to change members.
:class:`LeaderFollower` watches the record and, when the rendezvous changes,

- re-points this process's relay (:class:`elastic_allreduce.rendezvous.relay.HorovodRendezvous`),
  which Horovod's clients (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT``, read by the next
  ``hvd.init()`` at a reset) and the process's own (readiness, progress) reach the launcher
  through, so that the next connection goes to the new launcher with its token;
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
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import LeaderRecord
from elastic_allreduce.rendezvous.protocol import Endpoint
from elastic_allreduce.rendezvous.relay import HorovodRendezvous
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
    """Send the kept registration to the launcher's rendezvous through this process's relay at
    ``host:port``, as Horovod does; whether one was sent."""
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
    """Watches ``launcher/leader`` and follows its rendezvous (module docstring)."""

    def __init__(
        self, store: Store, slot: str, endpoint: Endpoint, horovod: HorovodRendezvous
    ) -> None:
        #: The relay this process's clients reach the launcher through.
        self._horovod = horovod
        self._changed = threading.Condition()
        self._endpoint = endpoint
        self._stop = threading.Event()
        self._watch: Watch = store.watch_prefix(keys.LEADER)
        self._thread = threading.Thread(target=self._run, name=f"follow-{slot}", daemon=True)

    @property
    def endpoint(self) -> Endpoint:
        """The launcher's rendezvous as this process knows it now."""
        with self._changed:
            return self._endpoint

    def wait_for_move(self, since: Endpoint, timeout: float) -> bool:
        """Wait until the process follows another rendezvous than ``since`` (a new launcher);
        whether it does within ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self._endpoint != since, timeout)

    def start(self, store: Store | None = None) -> None:
        """Point the relay at the rendezvous and start following (with ``store``: from the
        leader record as it is now)."""
        self._horovod.point(self._endpoint.address, self._endpoint.token)
        if store is not None:
            current = store.get(keys.LEADER)
            with contextlib.suppress(ElasticAllreduceError):
                if current is not None:
                    moved = LeaderRecord.from_json(current.key, current.value).endpoint()
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
        endpoint = record.endpoint()
        if endpoint is not None:
            self.follow(endpoint)

    def follow(self, endpoint: Endpoint) -> None:
        """Point the relay (Horovod, the beacon) and the notification service at ``endpoint``."""
        with self._changed:
            if endpoint == self._endpoint:
                return
            try:
                host, port = self._horovod.point(endpoint.address, endpoint.token)
            except (OSError, ElasticAllreduceError) as exc:
                log.warning("ignoring the launcher's rendezvous %r: %s", endpoint.address, exc)
                return
            self._endpoint = endpoint
            self._changed.notify_all()
        try:
            registered = register_again(host, port)
        except (OSError, RuntimeError, ElasticAllreduceError) as exc:
            log.warning("could not register with the new launcher: %s", exc)
            registered = False
        # The agent's prefix of each line it relays names the slot.
        log.info(
            "the job's launcher moved to %s%s",
            endpoint.address,
            "; registered with it" if registered else "",
        )
