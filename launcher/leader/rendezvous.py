"""The Gloo rendezvous that Horovod workers talk to, on Horovod's own HTTP server classes.

It serves the protocol of :mod:`elastic_allreduce.rendezvous.protocol` (scopes, request keys and
reply encodings are defined there, once, for this server and its clients):

* ``rank_and_size`` -- a surviving worker re-initialising after a reset. The request is held
  open until the launcher starts the next epoch (every member has asked), then answered with the
  slot's ranks: no member enters ``hvd.init()``'s Gloo rendezvous before all of them can (a
  member that never arrives would abort its peers inside Gloo).
* ``elastic_ready`` -- the same barrier for a fresh process (our bootstrap), which Horovod would
  not ask because its first ``hvd.init()`` reads the ranks from the environment.
  ``elastic_warm_ready`` is the barrier of a warm joiner (``--warm-join``), whose Horovod ran as
  a ring of one before: its ``hvd.init()`` in the ring then asks ``rank_and_size``, answered
  at once with the same ranks (not a reset) while its epoch is the newest.
* ``elastic_epoch`` -- the ring epoch the slot was last admitted to; a worker asks after each
  reset, since Horovod keeps the answer of ``rank_and_size`` to itself.
* ``worker_addresses`` -- a worker's notification service; the launcher uses it to send
  host-update notifications, which make ``state.commit()`` raise ``HostsUpdatedInterrupt``.
  The body is read with a plain-data loader (Horovod's own codec is cloudpickle, which would
  run code sent by anyone who reaches this port) and is never stored or served back.

Everything else is Horovod's key-value store for Gloo's own rendezvous, cleared when an epoch
starts.

Every request must carry the launcher's token (``protocol.TOKEN_HEADER``); one without it, or
with another, is answered 403, logged with the sender's address, and changes nothing. The
server listens on the address the launcher advertises only. Host-update notifications are
signed with the worker's own key (Horovod's wire format); the worker's acknowledgement is read
with a loader that accepts Horovod's acknowledgement and nothing else (Horovod's own reader
unpickles whatever a registered address answers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from horovod.runner.common.util import secret
from horovod.runner.common.util.network import AckResponse, Wire
from horovod.runner.elastic.worker import HostsUpdatedRequest, HostUpdateResult
from horovod.runner.http.http_server import (
    BAD_REQUEST,
    OK,
    RendezvousHandler,
    RendezvousHTTPServer,
)

from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.model import REMOVED
from elastic_allreduce.rendezvous.protocol import (
    Admission,
    ProgressReport,
    StacksReport,
    WaitKind,
    WorkerAddresses,
)
from launcher.leader.watchdog import ProgressBoard

log = logging.getLogger(__name__)


class ReadinessBoard:
    """Slots that are blocked waiting for their next epoch, and the answers they get.

    Thread-safe: HTTP handler threads wait here, the launcher's controller answers.
    """

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[str, WaitKind] = {}
        self._answers: dict[str, Admission] = {}
        #: The epoch each slot was last admitted to (what ``GET /elastic_epoch/<slot>`` says).
        self._admitted: dict[str, int] = {}
        #: Warm joiners admitted and not yet initialised in their epoch: their admission.
        self._warm: dict[str, Admission] = {}
        #: The newest epoch any slot was admitted to.
        self._newest = 0
        #: Each waiting slot's newest request: an older one is superseded (its process died
        #: with the request open, and the slot's next process asks now).
        self._tickets: dict[str, int] = {}
        self._issued = 0
        self._on_change = on_change
        self._closed = False

    def wait(self, slot: str, kind: WaitKind, timeout: float, *, warm: bool = False) -> Admission:
        """Register ``slot`` as ready and block until answered (REMOVED after ``timeout``).

        ``warm``: a warm joiner's barrier; its next RESET request in the epoch it is admitted
        to is answered at once with the same ranks (:meth:`warm_init`).

        A second request for ``slot`` supersedes this one, which then returns REMOVED at once:
        a SIGKILLed process leaves its request open here, and only the slot's live process can
        ask again, so the answer must reach the newest request."""
        with self._cond:
            self._issued += 1
            ticket = self._issued
            self._tickets[slot] = ticket
            self._warm.pop(slot, None)
            self._answers.pop(slot, None)
            self._waiting[slot] = kind
            self._cond.notify_all()
        self._on_change()
        deadline = time.monotonic() + timeout
        with self._cond:
            while (
                slot not in self._answers and self._tickets.get(slot) == ticket and not self._closed
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._tickets.get(slot) != ticket:
                log.info("slot %s: a newer request of the slot superseded an open one", slot)
                return Admission(-1, REMOVED)
            del self._tickets[slot]
            self._waiting.pop(slot, None)
            answer = self._answers.pop(slot, None)
            if warm and answer is not None and answer.admitted:
                self._warm[slot] = answer
        if answer is None:
            log.warning(
                "slot %s: no epoch formed within %.0f s; telling it to leave", slot, timeout
            )
            self._on_change()
            return Admission(-1, REMOVED)
        return answer

    def warm_init(self, slot: str) -> Admission | None:
        """A warm joiner's first ``rank_and_size`` in the epoch it was admitted to: its
        admission, once (Horovod asks because it was initialised before, as a ring of one);
        None for every other request, which waits as a reset -- also when a newer epoch
        started meanwhile, of which the warm joiner is a member like any other."""
        with self._cond:
            admission = self._warm.pop(slot, None)
            if admission is None or admission.epoch != self._newest:
                return None
            return admission

    def waiting(self) -> Mapping[str, WaitKind]:
        """Slots waiting now, with how they asked."""
        with self._cond:
            return dict(self._waiting)

    def answer(self, answers: Mapping[str, Admission]) -> None:
        """Release waiting slots with their answers."""
        with self._cond:
            for slot, answer in answers.items():
                if self._waiting.pop(slot, None) is not None:
                    self._answers[slot] = answer
                    if answer.admitted:
                        self._admitted[slot] = answer.epoch
                        self._newest = max(self._newest, answer.epoch)
            self._cond.notify_all()

    def admitted_epoch(self, slot: str) -> int | None:
        """The ring epoch ``slot`` was last admitted to, if any."""
        with self._cond:
            return self._admitted.get(slot)

    def close(self) -> None:
        """Release every waiter (with REMOVED)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


#: The answer to a request without the launcher's token.
FORBIDDEN: Final = 403

#: Seconds between re-sends of an unacknowledged notification, and how long to keep trying.
RESEND_INTERVAL: Final = 1.0
RESEND_FOR: Final = 60.0


@dataclass(frozen=True)
class _Pending:
    timestamp: int
    first_sent: float
    last_sent: float


class RendezvousService:
    """Horovod's rendezvous HTTP server with the elastic protocol answered by a ReadinessBoard."""

    def __init__(
        self, board: ReadinessBoard, *, wait_timeout: float, progress: ProgressBoard | None = None
    ) -> None:
        self.board = board
        self.wait_timeout = wait_timeout
        #: Where progress reports and stacks land (``PUT /progress``, ``/stacks``).
        self.progress = progress or ProgressBoard()
        self._httpd: RendezvousHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._clients: dict[str, WorkerAddresses] = {}
        #: The newest notification for each slot, re-sent when a slot (re)registers (a worker
        #: that registers after a resize was decided must still hear of it) and every
        #: RESEND_INTERVAL until the slot reaches the new epoch: Horovod drops the messages that
        #: arrive while a worker is still resetting into the previous epoch.
        self._pending: dict[str, _Pending] = {}
        self._clients_lock = threading.Lock()
        self.port = 0
        #: What every request must carry in ``protocol.TOKEN_HEADER`` (set by :meth:`start`).
        self.token: str | None = None
        #: The launcher's answer to ``node_standing`` (set by its loop; read by server threads).
        self.members: frozenset[str] = frozenset()
        self.epoch = 0

    def standing(self, node: str) -> protocol.NodeStanding:
        """Whether the launcher counts ``node`` as a member now (see :attr:`members`)."""
        return protocol.NodeStanding(self.epoch, node in self.members)

    def start(self, host: str, token: str) -> int:
        """Start serving on a free port of ``host`` (the address workers are told), answering
        only requests that carry ``token``; return the port."""
        self.token = token
        httpd = self._httpd = _listen(host, _make_handler(self))
        self.port = int(httpd.server_address[1])
        httpd.init([])
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="rendezvous-server", daemon=True
        )
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Release waiters and stop the server (if it was started)."""
        self.board.close()
        if self._httpd is not None and self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._httpd.server_close()

    def clear_gloo_scopes(self) -> None:
        """Forget Gloo's rendezvous keys of earlier epochs (called as an epoch starts)."""
        if self._httpd is not None:
            self._httpd.init([])

    def register_worker(self, slot: str, worker: WorkerAddresses) -> None:
        """Remember a worker's notification service (from ``PUT /worker_addresses``)."""
        with self._clients_lock:
            self._clients[slot] = worker
            pending = self._pending.get(slot)
        if pending is not None:
            self._send(slot, worker, pending.timestamp)

    def notify(self, slots: list[str], timestamp: int) -> None:
        """Tell workers that membership changed; each sends it to its State at next commit."""
        now = time.monotonic()
        with self._clients_lock:
            for slot in slots:
                self._pending[slot] = _Pending(timestamp, now, now)
            targets = [(s, self._clients[s]) for s in slots if s in self._clients]
        for slot, worker in targets:
            self._send(slot, worker, timestamp)

    def resend_pending(self) -> None:
        """Send again the notifications not yet acknowledged (see ``_pending``); a worker
        ignores a notification it has already seen. Cheap when nothing is pending."""
        now = time.monotonic()
        targets = []
        with self._clients_lock:
            for slot, pending in self._pending.items():
                due = now - pending.last_sent >= RESEND_INTERVAL
                if due and now - pending.first_sent < RESEND_FOR and slot in self._clients:
                    self._pending[slot] = dataclasses.replace(pending, last_sent=now)
                    targets.append((slot, self._clients[slot], pending))
        for slot, worker, pending in targets:
            self._send(slot, worker, pending.timestamp, again=True)

    def forget(self, slots: list[str]) -> None:
        """Drop pending notifications of slots that reached the new epoch."""
        with self._clients_lock:
            for slot in slots:
                self._pending.pop(slot, None)

    @staticmethod
    def _send(slot: str, worker: WorkerAddresses, timestamp: int, *, again: bool = False) -> None:
        update = HostUpdateResult.added  # see launcher.leader.policy.NotifyWorkers
        threading.Thread(
            target=_notify_one,
            args=(slot, worker, timestamp, update),
            kwargs={"again": again},
            name=f"notify-{slot}",
            daemon=True,
        ).start()


class _IPv6HTTPServer(RendezvousHTTPServer):  # type: ignore[misc]
    """Horovod's rendezvous HTTP server on an IPv6 address (Horovod's binds IPv4 only)."""

    address_family = socket.AF_INET6


def _listen(host: str, handler: type[RendezvousHandler]) -> RendezvousHTTPServer:
    """The rendezvous server bound to a free port of ``host`` only."""
    server = _IPv6HTTPServer if protocol.is_ipv6(host) else RendezvousHTTPServer
    return server((host, 0), handler, 0)


#: Seconds a host-update notification may take to connect and be acknowledged, per address.
NOTIFY_TIMEOUT: Final = 20.0
#: The largest acknowledgement read from a worker's notification service.
_MAX_REPLY: Final = 4096


_ACK: Final[type] = AckResponse


class _AckUnpickler(pickle.Unpickler):
    """Loads Horovod's acknowledgement (``AckResponse``, an empty object) and refuses every
    other class or function before anything runs."""

    def find_class(self, module: str, name: str) -> type:
        if (module, name) == (_ACK.__module__, _ACK.__name__):
            return _ACK
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only an acknowledgement")


def read_ack(rfile: io.BufferedIOBase, key: bytes) -> None:
    """Read a worker's answer to a notification in Horovod's wire format (an HMAC of the
    message with the worker's key, the length, the pickled message); ProtocolError unless it
    is a correctly signed ``AckResponse``."""
    digest = rfile.read(secret.DIGEST_LENGTH)
    size = rfile.read(4)
    length = struct.unpack("i", size)[0] if len(size) == 4 else 0  # native order, as Horovod's
    if len(digest) != secret.DIGEST_LENGTH or not 0 < length <= _MAX_REPLY:
        raise ProtocolError(f"not an acknowledgement (length {length})")
    message = rfile.read(length)
    if len(message) != length or not secret.check_digest(key, message, digest):
        raise ProtocolError("an acknowledgement whose signature does not match")
    try:
        reply = _AckUnpickler(io.BytesIO(message)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"not an acknowledgement: {exc}") from None
    if not isinstance(reply, AckResponse):
        raise ProtocolError(f"answered {reply!r:.60} instead of an acknowledgement")


def _notify_any_family(
    worker: WorkerAddresses, timestamp: int, update: HostUpdateResult, timeout: float
) -> None:
    """Send a host-update notification to the first of ``worker``'s addresses that takes it,
    in Horovod's wire format (signed with the worker's key), over IPv4 or IPv6 (Horovod's
    client connects over IPv4 only and unpickles any answer). Raises (OSError, ProtocolError)
    when none does."""
    wire = Wire(worker.secret_key)
    failures = []
    for _, pairs in worker.addresses:
        for host, port in pairs:
            try:
                with (
                    socket.create_connection((host, port), timeout) as sock,
                    sock.makefile("rb") as rfile,
                    sock.makefile("wb") as wfile,
                ):
                    wire.write(HostsUpdatedRequest(timestamp, update), wfile)
                    wfile.flush()
                    read_ack(rfile, worker.secret_key)
            except (OSError, ProtocolError) as exc:
                failures.append(f"{protocol.host_port(host, port)}: {exc}")
                continue
            return
    raise ProtocolError("; ".join(failures) or "no address registered")


def _notify_one(
    slot: str, worker: WorkerAddresses, timestamp: int, update: HostUpdateResult, *, again: bool
) -> None:
    try:
        _notify_any_family(worker, timestamp, update, NOTIFY_TIMEOUT)
    except (OSError, ProtocolError) as exc:  # a worker that died meanwhile cannot be notified
        level = logging.DEBUG if again else logging.INFO
        log.log(level, "slot %s: host-update notification not delivered: %s", slot, exc)


def _make_handler(service: RendezvousService) -> type[RendezvousHandler]:
    class ElasticHandler(RendezvousHandler):  # type: ignore[misc]
        def parse_request(self) -> bool:
            """Parse the request head; refuse (403) one without the launcher's token."""
            if not super().parse_request():
                return False
            token = service.token
            if token is not None and protocol.authorized(
                self.headers.get(protocol.TOKEN_HEADER), token
            ):
                return True
            log.warning(
                "refused %s %s from %s: %s",
                self.command,
                self.path[:80],
                self.client_address[0],
                "no token" if protocol.TOKEN_HEADER not in self.headers else "a wrong token",
            )
            self._discard_body()
            self.send_status_code(FORBIDDEN)
            return False

        def _discard_body(self) -> None:
            # Read a small body, so that the client (still sending it) gets the answer
            # rather than a reset; a large one is left for the close to cut off.
            with contextlib.suppress(ValueError, OSError):
                length = int(self.headers.get("Content-Length", "0"))
                if 0 < length <= protocol.MAX_WORKER_ADDRESSES_BYTES:
                    self.rfile.read(length)

        def _get_value(self, scope: str, key: str) -> bytes | None:
            if scope == protocol.RANK_AND_SIZE:
                slot = protocol.slot_of_worker_key(key)
                answer = service.board.warm_init(slot) or service.board.wait(
                    slot, WaitKind.RESET, service.wait_timeout
                )
                return protocol.encode_assignment(answer.assignment)
            if scope == protocol.ELASTIC_EPOCH:
                epoch = service.board.admitted_epoch(key)
                return None if epoch is None else protocol.encode_epoch(epoch)
            if scope == protocol.NODE_STANDING:
                return service.standing(key).encode()
            if scope in (protocol.ELASTIC_READY, protocol.WARM_READY):
                answer = service.board.wait(
                    key, WaitKind.FRESH, service.wait_timeout, warm=scope == protocol.WARM_READY
                )
                return protocol.encode_admission(answer)
            value: bytes | None = super()._get_value(scope, key)
            return value

        def _read_body(self, limit: int) -> bytes:
            length = int(self.headers.get("Content-Length", ""))
            if not 0 <= length <= limit:
                raise ProtocolError(f"a body of {length} bytes (limit {limit})")
            body: bytes = self.rfile.read(length)
            return body

        def _refuse(self, what: str, key: str, exc: Exception) -> None:
            log.warning("refused %s for %r from %s: %s", what, key, self.client_address[0], exc)
            self.send_status_code(BAD_REQUEST)

        def _reply(self, body: bytes) -> None:
            self.send_response(OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _progress(self, scope: str, key: str) -> None:
            """``PUT /progress/<slot>`` and ``PUT /stacks/<slot>``: parsed as typed records,
            never stored in the key-value store."""
            try:
                split_slot(key)
                if scope == protocol.PROGRESS:
                    report = ProgressReport.decode(self._read_body(protocol.MAX_PROGRESS_BYTES))
                else:
                    stacks = StacksReport.decode(self._read_body(protocol.MAX_STACKS_BYTES))
            except (ValueError, ProtocolError, OSError) as exc:
                self._refuse(f"a {scope} report", key, exc)
                return
            if scope == protocol.PROGRESS:
                reply = service.progress.receive(key, report, time.monotonic(), time.time())
                self._reply(reply.encode())
            else:
                service.progress.receive_stacks(key, stacks)
                self.send_status_code(OK)

        def do_PUT(self) -> None:
            _, _, rest = self.path.partition("/")
            scope, _, key = rest.partition("/")
            if scope in (protocol.PROGRESS, protocol.STACKS):
                self._progress(scope, key)
                return
            if scope != protocol.WORKER_ADDRESSES:
                super().do_PUT()
                return
            # Read with the plain-data loader and kept out of the key-value store, so that
            # nothing from the network runs here and the worker's key is never served back.
            try:
                body = self._read_body(protocol.MAX_WORKER_ADDRESSES_BYTES)
                worker = protocol.decode_worker_addresses(body)
                slot = protocol.slot_of_worker_key(key)
                split_slot(slot)
            except (ValueError, ProtocolError, OSError) as exc:
                self._refuse("a worker_addresses registration", key, exc)
                return
            service.register_worker(slot, worker)
            self.send_status_code(OK)

    return ElasticHandler
