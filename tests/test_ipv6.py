"""A launcher on an IPv6 address (elastic_allreduce/bootstrap/ipv6.py,
launcher/leader/rendezvous.py): the notification service on both families and the launcher's
notifications to it, the relay's connections kept apart from Gloo's (the relay itself:
tests/test_relay.py). Real sockets on loopback."""

from __future__ import annotations

import threading

import pytest
from horovod.runner.common.util import secret
from horovod.runner.elastic import worker
from horovod.runner.elastic.worker import HostUpdateResult

from elastic_allreduce.bootstrap import ipv6
from elastic_allreduce.bootstrap.sockets import TcpSocket, gloo_connections
from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous import protocol
from launcher.leader import rendezvous as launcher_rendezvous
from tests.test_relay import closed_port
from tests.test_ring_guard import ipv6_loopback

pytestmark = [
    pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here"),
    pytest.mark.timeout(60),
]


class Manager:
    """Horovod's WorkerNotificationManager, as far as its service calls it."""

    def __init__(self) -> None:
        self.updates: list[tuple[int, int]] = []
        self.event = threading.Event()

    def handle_hosts_updated(self, timestamp: int, result: int) -> None:
        self.updates.append((timestamp, result))
        self.event.set()


def test_the_notification_service_listens_and_advertises_ipv6_and_the_launcher_reaches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker, "WorkerNotificationService", worker.WorkerNotificationService)
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "lo")
    launcher_port = closed_port("::1")  # the route is all that counts; nothing is sent
    ipv6.serve_notifications_over_ipv6("::1", launcher_port)
    ipv6.serve_notifications_over_ipv6("::1", launcher_port)  # idempotent
    key = secret.make_secret_key()
    manager = Manager()
    service = worker.WorkerNotificationService(key, "lo", manager)
    try:
        addresses = service.addresses()
        assert addresses == {"lo": [("::1", service.get_port())]}
        # What the launcher decodes from the worker's registration, and how it notifies.
        registered = protocol.WorkerAddresses((("lo", (("::1", service.get_port()),)),), key)
        launcher_rendezvous._notify_one("n0.0", registered, 7, HostUpdateResult.added, again=False)
        assert manager.event.wait(10)
        assert manager.updates == [(7, HostUpdateResult.added)]
        # The same service takes IPv4 (mapped) connections too.
        over_v4 = protocol.WorkerAddresses((("lo", (("127.0.0.1", service.get_port()),)),), key)
        launcher_rendezvous._notify_any_family(over_v4, 8, HostUpdateResult.added, 5)
        assert manager.updates[-1] == (8, HostUpdateResult.added)
        # A wrong key is refused (Horovod's signed wire format).
        forged = protocol.WorkerAddresses(
            (("lo", (("::1", service.get_port()),)),), secret.make_secret_key()
        )
        with pytest.raises(ProtocolError, match="::1"):
            launcher_rendezvous._notify_any_family(forged, 9, HostUpdateResult.added, 5)
        assert [u[0] for u in manager.updates] == [7, 8]
    finally:
        service.shutdown()


def test_the_relay_s_end_of_horovod_s_connections_is_not_taken_for_gloo_s() -> None:
    relay_port, launcher_port, peer_port = 40001, 40002, 40003
    sockets = {
        1: TcpSocket(1, "01", 50000, relay_port),  # Horovod's store -> relay: remote port
        2: TcpSocket(2, "01", relay_port, 50000),  # the relay's accepted end: local port
        3: TcpSocket(3, "01", 50001, launcher_port),  # the relay -> the launcher
        4: TcpSocket(4, "01", 50002, peer_port),  # a Gloo pair
    }
    found = gloo_connections(sockets, sockets, {relay_port, launcher_port}, {relay_port})
    assert found == {4}
