"""A launcher on an IPv6 address, for Horovod 0.28.1 clients that speak IPv4 only.

Two of Horovod's clients in a training process cannot reach an IPv6 address, and one of its
services listens on IPv4 only; nothing here changes Horovod's code:

- its C++ Gloo rendezvous store (``http_store.cc``, reached through
  ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT``) fails on an IPv6 address with or without
  brackets, and its Python ``put_data_into_kvstore`` writes the address into the URL without
  brackets. So when the launcher's address is IPv6, :class:`HorovodRendezvous` starts a
  :class:`Relay` in the process: a daemon thread accepting on ``127.0.0.1:<ephemeral>`` that
  pipes every connection both ways to the launcher, and points Horovod's variables at it.
  A launcher takeover re-points the relay (:meth:`HorovodRendezvous.point`); a connection made
  after that reaches the new launcher, one already open stays with the old one, as Horovod's
  own would. A relay that cannot connect closes the client's connection at once: Horovod then
  sees what it sees from a dead launcher (and retries). Our own clients (urllib) put the
  brackets in themselves (:mod:`elastic_allreduce.rendezvous.protocol`) and go direct.
- its worker notification service (which the launcher calls to announce a grown ring) binds
  IPv4 only and advertises only IPv4 addresses: on a host with none on its Gloo interface it
  raises ``NoValidAddressesFound``. :func:`serve_notifications_over_ipv6` swaps in a subclass
  listening on both families and advertising this host's address on the route to the launcher
  (the launcher's side sends to it with :func:`launcher.rendezvous` 's family-neutral client).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import socketserver
import threading
from typing import Any, Final

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError
from elastic_allreduce.rendezvous import protocol

log = logging.getLogger(__name__)

#: Where the relay listens: Horovod's clients reach IPv4 loopback, which an IPv6-only host has.
RELAY_HOST: Final = "127.0.0.1"
_CHUNK: Final = 64 * 1024


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
    """Accepts on ``127.0.0.1:<ephemeral>`` and pipes each connection both ways to the target
    (``host``, ``port``), which :meth:`retarget` changes for the connections that follow.

    One daemon thread accepts; each connection gets a thread per direction for its life (all
    block in ``accept``/``recv``: nothing polls). Lives as long as the process or until
    :meth:`close`."""

    def __init__(self, host: str, port: int) -> None:
        self._lock = threading.Lock()
        self._target = (host, port)
        self._closed = threading.Event()
        self._listener = socket.create_server((RELAY_HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=self._accept, name=f"rendezvous-relay-{self.port}", daemon=True
        )
        self._thread.start()
        log.info("relaying %s to %s for Horovod", self.address, protocol.host_port(host, port))

    @property
    def address(self) -> str:
        """Where Horovod's clients connect: ``127.0.0.1:<port>``."""
        return protocol.host_port(RELAY_HOST, self.port)

    @property
    def target(self) -> tuple[str, int]:
        """Where new connections are piped to."""
        with self._lock:
            return self._target

    def retarget(self, host: str, port: int) -> None:
        """Pipe the connections accepted from now on to ``host:port`` (a new launcher)."""
        with self._lock:
            self._target = (host, port)

    def close(self) -> None:
        """Stop accepting (connections being piped run to their end)."""
        self._closed.set()
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
        host, port = self.target
        with client:
            try:
                upstream = socket.create_connection((host, port))
            except OSError as exc:
                # Closing the client's connection unanswered is what a dead launcher does too.
                log.debug("rendezvous relay: cannot reach %s: %s", (host, port), exc)
                return
            with upstream:
                _nodelay(client)
                _nodelay(upstream)
                back = threading.Thread(
                    target=_copy, args=(upstream, client), name="rendezvous-relay-back", daemon=True
                )
                back.start()
                _copy(client, upstream)
                back.join()


class HorovodRendezvous:
    """Where Horovod's own clients in this process reach the launcher's rendezvous: the
    launcher itself, or (for an IPv6 address) a local :class:`Relay` to it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._relay: Relay | None = None

    @property
    def relay(self) -> Relay | None:
        """The relay, once an IPv6 launcher made one."""
        with self._lock:
            return self._relay

    def point(self, address: str) -> tuple[str, int]:
        """Point Horovod (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT``, read by its next
        ``hvd.init()`` and notification registration) at the launcher at ``address``; the host
        and port Horovod now uses. An IPv6 launcher is reached through the relay, made on
        first need and re-pointed afterwards."""
        host, port = protocol.split_host_port(address)
        if protocol.is_ipv6(host):
            with self._lock:
                if self._relay is None:
                    self._relay = Relay(host, port)
                else:
                    self._relay.retarget(host, port)
                host, port = RELAY_HOST, self._relay.port
        os.environ[env.HOROVOD_RENDEZVOUS_ADDR] = host
        os.environ[env.HOROVOD_RENDEZVOUS_PORT] = str(port)
        return host, port

    def close(self) -> None:
        """Stop the relay, if any."""
        with self._lock:
            relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()


def route_source(host: str, port: int) -> str:
    """The address this host sends from to reach ``host:port`` (nothing is sent: connecting a
    UDP socket only picks the route); ConfigError when no route leads there."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve {host!r}: {exc}") from exc
    reasons = []
    for family, kind, proto, _, target in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(target)
            except OSError as exc:
                reasons.append(str(exc))
                continue
            return str(probe.getsockname()[0]).split("%", 1)[0]
    raise ConfigError(f"no route from this host to {host} ({'; '.join(reasons) or 'no address'})")


class _DualStackServer(socketserver.ThreadingTCPServer):
    """A threading TCP server on ``[::]``, accepting IPv4 (mapped) and IPv6 connections."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def serve_notifications_over_ipv6(launcher_host: str, launcher_port: int) -> None:
    """Make Horovod's worker notification service, created at the first ``hvd.elastic.run``,
    listen on both families and advertise this host's address on the route to the launcher
    at ``launcher_host`` (an IPv6 one): Horovod's binds IPv4 only and advertises the IPv4
    addresses of its interface (none on an IPv6-only host). Idempotent."""
    from horovod.runner.common.util import network  # noqa: PLC0415 - Horovod loads late
    from horovod.runner.elastic import worker  # noqa: PLC0415
    from horovod.runner.util.threads import in_thread  # noqa: PLC0415

    stock = worker.WorkerNotificationService
    if getattr(stock, "_elastic_allreduce_ipv6", False):
        return
    advertised = route_source(launcher_host, launcher_port)
    interface = os.environ.get("HOROVOD_GLOO_IFACE") or "route"

    class Service(stock):  # type: ignore[misc, valid-type]
        """Horovod's service; only its socket and its advertised address differ."""

        _elastic_allreduce_ipv6 = True

        def __init__(self, key: bytes, nic: str | None, manager: Any) -> None:  # noqa: ANN401
            # network.BasicService.__init__, on a socket of both families.
            self._service_name = stock.NAME
            self._wire = network.Wire(key)
            self._nics = nic
            self._server = _DualStackServer(("", 0), self._make_handler())
            self._port = self._server.socket.getsockname()[1]
            self._addresses = {interface: [(advertised, self._port)]}
            self._thread = in_thread(target=self._server.serve_forever)
            self._manager = manager

    worker.WorkerNotificationService = Service
    log.info("the notification service listens on IPv6 too, advertised at %s", advertised)
