"""How a training process reaches the launcher's rendezvous: through a relay that adds the token.

The launcher's rendezvous answers only requests that carry its token
(:data:`~elastic_allreduce.rendezvous.protocol.TOKEN_HEADER`). Horovod's clients in a training
process cannot send one: its C++ Gloo rendezvous store (``http_store.cc``, reached through
``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT``) and its Python elastic clients (``rank_and_size``,
``worker_addresses``) build their requests themselves. Nor can they reach an IPv6 address (the
C++ store fails on one with or without brackets; the Python client puts none around it).

So :class:`HorovodRendezvous` points Horovod's variables at a :class:`Relay` of the process: a
daemon thread accepting on ``127.0.0.1:<ephemeral>`` that reads each connection's request head,
sets the token header in it, and then pipes the connection both ways to the launcher (IPv4 or
IPv6). The rendezvous server speaks HTTP/1.0 (one request per connection), so the first head is
the only one. The process's own clients (readiness, progress, stacks) use the relay too, so the
token lives in one place. A launcher takeover re-points the relay with the new launcher's
address and token (:meth:`HorovodRendezvous.point`); a connection made after that reaches the
new launcher, one already open stays with the old one, as Horovod's own would. A relay that
cannot connect closes the client's connection at once: Horovod then sees what it sees from a
dead launcher (and retries) -- except for Horovod's wait for its ranks after a reset
(``rank_and_size``, which the C++ store sends and tries only three times, 0.5 s apart, before it
aborts the process): that request waits in the relay for a launcher to reach, up to
:data:`HOLD_S`, so a survivor waiting to re-form when its launcher dies waits for the successor
(which re-points the relay) instead of aborting and costing a restart.

The relay listens on loopback: on Kubernetes that is the pod's own; on a shared machine any
local user could send requests through it while the job runs (docs/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Final

from elastic_allreduce import env
from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous import protocol

log = logging.getLogger(__name__)

#: Where the relay listens: Horovod's clients reach IPv4 loopback, which an IPv6-only host has.
RELAY_HOST: Final = "127.0.0.1"
_CHUNK: Final = 64 * 1024
#: The longest request head the relay reads (Horovod's are well under 1 KiB).
MAX_HEAD: Final = 16 * 1024
_END_OF_HEAD: Final = b"\r\n\r\n"
#: How long a held request (:func:`held`) waits for a launcher to reach: a standby takes over
#: within a few lease TTLs, the same command started again somewhat later.
HOLD_S: Final = 60.0
#: One try to connect to the launcher: a dead pod's address may drop packets, not refuse (a
#: live launcher with a full accept queue drops SYNs too, retried after 1 and 3 s).
CONNECT_TIMEOUT_S: Final = 15.0
#: While a request is held, the same launcher is tried again this often (it may have been slow).
RETRY_S: Final = 1.0


def with_token(head: bytes, token: str | None) -> bytes:
    """An HTTP request head (request line and header lines, ending with an empty line) with
    the token header set to ``token`` (any the client sent removed; none added for None).
    ProtocolError when ``head`` is not a request head."""
    if not head.endswith(_END_OF_HEAD):
        raise ProtocolError("an HTTP request head must end with an empty line")
    request_line, _, rest = head[: -len(_END_OF_HEAD)].partition(b"\r\n")
    if request_line.count(b" ") != 2:
        raise ProtocolError(f"not an HTTP request line: {request_line[:80]!r}")
    name = protocol.TOKEN_HEADER.lower().encode("ascii")
    fields = [
        line
        for line in rest.split(b"\r\n")
        if line and line.partition(b":")[0].strip().lower() != name
    ]
    if token is not None:
        fields.append(f"{protocol.TOKEN_HEADER}: {token}".encode("ascii"))
    return b"\r\n".join([request_line, *fields]) + _END_OF_HEAD


def held(head: bytes) -> bool:
    """Whether a request waits in the relay for a launcher to reach, rather than being closed
    unanswered when there is none: Horovod's ``rank_and_size`` (its clients of every other
    scope retry, or are ours and follow a new launcher themselves)."""
    request_line = head.partition(b"\r\n")[0]
    path = request_line.split(b" ")[1] if request_line.count(b" ") == 2 else b""
    return path.split(b"/")[1:2] == [protocol.RANK_AND_SIZE.encode("ascii")]


def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """Read a request head from ``sock``: (the head with its empty line, what followed it).
    ProtocolError when the connection ends first or the head is longer than MAX_HEAD."""
    data = b""
    while (end := data.find(_END_OF_HEAD)) < 0:
        if len(data) > MAX_HEAD:
            raise ProtocolError(f"a request head longer than {MAX_HEAD} bytes")
        chunk = sock.recv(_CHUNK)
        if not chunk:
            raise ProtocolError("the connection ended inside a request head")
        data += chunk
    end += len(_END_OF_HEAD)
    return data[:end], data[end:]


def _nodelay(sock: socket.socket) -> None:
    # Small HTTP messages written in pieces must not wait for the peer's delayed ACK.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _copy(source: socket.socket, sink: socket.socket) -> None:
    """Copy ``source`` to ``sink`` until its end, which is passed on (half-close); an error on
    either side (a reset) ends both directions."""
    try:
        while data := source.recv(_CHUNK):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class Relay:
    """Accepts on ``127.0.0.1:<ephemeral>``, sets the token in each connection's request head
    and pipes the connection both ways to the target (``host``, ``port``), which
    :meth:`retarget` changes (with its token) for the connections that follow.

    One daemon thread accepts; each connection gets a thread per direction for its life (all
    block in ``accept``/``recv``: nothing polls). Lives as long as the process or until
    :meth:`close`."""

    def __init__(self, host: str, port: int, token: str | None, *, hold_s: float = HOLD_S) -> None:
        self._lock = threading.Lock()
        #: Notified when the target changes or the relay closes (held requests wait on it).
        self._retargeted = threading.Condition(self._lock)
        self._target = (host, port)
        self._token = token
        self._hold_s = hold_s
        self._closed = threading.Event()
        self._listener = socket.create_server((RELAY_HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=self._accept, name=f"rendezvous-relay-{self.port}", daemon=True
        )
        self._thread.start()
        log.info("relaying %s to %s", self.address, protocol.host_port(host, port))

    @property
    def address(self) -> str:
        """Where the process's clients connect: ``127.0.0.1:<port>``."""
        return protocol.host_port(RELAY_HOST, self.port)

    @property
    def target(self) -> tuple[str, int]:
        """Where new connections are piped to."""
        with self._lock:
            return self._target

    def retarget(self, host: str, port: int, token: str | None) -> None:
        """Pipe the connections accepted from now on to ``host:port`` (a new launcher), with
        its token."""
        with self._lock:
            self._target = (host, port)
            self._token = token
            self._retargeted.notify_all()

    def close(self) -> None:
        """Stop accepting (connections being piped run to their end; held ones are closed)."""
        self._closed.set()
        with self._lock:
            self._retargeted.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self._listener.close()
        self._thread.join(timeout=5.0)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # Out of descriptors or memory: back off a little instead of spinning.
                log.warning("rendezvous relay: accept failed: %s", exc)
                self._closed.wait(0.1)
                continue
            threading.Thread(
                target=self._serve, args=(client,), name="rendezvous-relay-pipe", daemon=True
            ).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            _nodelay(client)
            try:
                head, rest = read_head(client)
                with_token(head, None)  # a request head, or the connection is dropped
            except (OSError, ProtocolError) as exc:
                log.debug("rendezvous relay: dropped a connection: %s", exc)
                return
            connected = self._connect(self._hold_s if held(head) else 0.0)
            if connected is None:
                # Closing the client's connection unanswered is what a dead launcher does too.
                return
            upstream, token = connected
            with upstream:
                _nodelay(upstream)
                back = threading.Thread(
                    target=_copy, args=(upstream, client), name="rendezvous-relay-back", daemon=True
                )
                back.start()
                try:
                    upstream.sendall(with_token(head, token) + rest)
                except OSError:
                    with contextlib.suppress(OSError):
                        upstream.shutdown(socket.SHUT_RDWR)
                else:
                    _copy(client, upstream)
                back.join()

    def _connect(self, hold_s: float) -> tuple[socket.socket, str | None] | None:
        """A connection to the target and its token; None when it cannot be reached. With
        ``hold_s`` it waits that long for a target that answers: the same one is tried again
        every RETRY_S, a new one (:meth:`retarget`) at once."""
        deadline = time.monotonic() + hold_s
        with self._lock:
            target, token = self._target, self._token
        while True:
            try:
                upstream = socket.create_connection(target, timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed.is_set():
                    log.debug("rendezvous relay: cannot reach %s: %s", target, exc)
                    return None
                with self._lock:
                    if self._target == target and not self._closed.is_set():
                        self._retargeted.wait(min(remaining, RETRY_S))
                    target, token = self._target, self._token
                continue
            upstream.settimeout(None)
            return upstream, token


class HorovodRendezvous:
    """Where this process's clients -- Horovod's and its own -- reach the launcher's
    rendezvous: a local :class:`Relay` that adds the launcher's token. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._relay: Relay | None = None

    @property
    def relay(self) -> Relay | None:
        """The relay, once :meth:`point` made it."""
        with self._lock:
            return self._relay

    def point(self, address: str, token: str | None) -> tuple[str, int]:
        """Point Horovod (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT``, read by its next
        ``hvd.init()`` and notification registration) at the launcher at ``address`` whose
        token is ``token``, through the relay (made on first need, re-pointed afterwards);
        the relay's host and port."""
        host, port = protocol.split_host_port(address)
        with self._lock:
            if self._relay is None:
                self._relay = Relay(host, port, token)
            else:
                self._relay.retarget(host, port, token)
            relay_port = self._relay.port
        os.environ[env.HOROVOD_RENDEZVOUS_ADDR] = RELAY_HOST
        os.environ[env.HOROVOD_RENDEZVOUS_PORT] = str(relay_port)
        return RELAY_HOST, relay_port

    def close(self) -> None:
        """Stop the relay, if any."""
        with self._lock:
            relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()
