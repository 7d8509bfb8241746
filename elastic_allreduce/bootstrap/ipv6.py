"""A launcher on an IPv6 address, for Horovod 0.28.1 clients that speak IPv4 only.

Horovod's clients in a training process reach an IPv6 launcher through the process's relay
(:mod:`elastic_allreduce.rendezvous.relay`), which listens on IPv4 loopback. One of its services
listens on IPv4 only; nothing here changes Horovod's code:

- its worker notification service (which the launcher calls to announce a grown ring) binds
  IPv4 only and advertises only IPv4 addresses: on a host with none on its Gloo interface it
  raises ``NoValidAddressesFound``. :func:`serve_notifications_over_ipv6` swaps in a subclass
  listening on both families and advertising this host's address on the route to the launcher
  (the launcher's side sends to it with :mod:`launcher.leader.rendezvous`'s family-neutral client).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import socketserver
from typing import Any

from elastic_allreduce import env, netinfo

log = logging.getLogger(__name__)


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
    advertised = netinfo.source_address(
        launcher_host, launcher_port, "check this host's network"
    ).split("%", 1)[0]
    interface = os.environ.get(env.HOROVOD_GLOO_IFACE) or "route"

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
