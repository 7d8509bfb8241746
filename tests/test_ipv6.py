"""A launcher on an IPv6 address (elastic_allreduce/ipv6.py, launcher/rendezvous.py): the relay
that Horovod's IPv4-only clients reach it through, where Horovod is pointed, the notification
service, and the launcher's rendezvous on both families. Real sockets on loopback."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from horovod.runner.common.util import secret
from horovod.runner.elastic import worker
from horovod.runner.elastic.worker import HostUpdateResult

from elastic_allreduce import env, ipv6
from elastic_allreduce.bootstrap import TcpSocket, gloo_connections
from elastic_allreduce.rendezvous import protocol
from launcher import rendezvous as launcher_rendezvous
from launcher.rendezvous import ReadinessBoard, RendezvousService
from tests.test_ring_guard import ipv6_loopback

pytestmark = [
    pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here"),
    pytest.mark.timeout(60),
]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6
    daemon_threads = True


class Upstream:
    """An HTTP server on ``[::1]``: GET answers its name, PUT echoes the body."""

    def __init__(self, name: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(name.encode())

            def do_PUT(self) -> None:
                self._answer(self.rfile.read(int(self.headers["Content-Length"])))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _V6Server(("::1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstreams() -> Iterator[Callable[[str], Upstream]]:
    made: list[Upstream] = []

    def make(name: str) -> Upstream:
        made.append(Upstream(name))
        return made[-1]

    yield make
    for upstream in made:
        upstream.close()


def get(address: str, path: str = "/x", data: bytes | None = None) -> bytes:
    request = urllib.request.Request(f"http://{address}{path}", data=data)
    if data is not None:
        request.get_method = lambda: "PUT"
    with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310 - http://
        body: bytes = reply.read()
        return body


def closed_v6_port() -> int:
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return int(sock.getsockname()[1])


def pipe_threads() -> int:
    return sum(t.name.startswith("rendezvous-relay-") for t in threading.enumerate())


def test_the_relay_pipes_http_both_ways_to_an_ipv6_launcher(
    upstreams: Callable[[str], Upstream],
) -> None:
    launcher = upstreams("launcher")
    relay = ipv6.Relay("::1", launcher.port)
    try:
        assert relay.address == f"127.0.0.1:{relay.port}"
        assert get(relay.address) == b"launcher"
        body = os.urandom(3 * 1024 * 1024)  # larger than any socket buffer, both ways
        assert get(relay.address, data=body) == body
        # Each connection's threads end with it: nothing is left running, nothing polls.
        wait_until(lambda: pipe_threads() == 1, 5, "only the accepting thread")
    finally:
        relay.close()
    assert pipe_threads() == 0
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", relay.port), 2):
        pass


def test_a_retargeted_relay_sends_new_connections_to_the_new_launcher(
    upstreams: Callable[[str], Upstream],
) -> None:
    old, new = upstreams("old"), upstreams("new")
    relay = ipv6.Relay("::1", old.port)
    try:
        assert get(relay.address) == b"old"
        relay.retarget("::1", new.port)
        assert relay.target == ("::1", new.port)
        assert get(relay.address) == b"new"
    finally:
        relay.close()


def test_a_relay_that_cannot_connect_closes_the_client_s_connection_at_once() -> None:
    relay = ipv6.Relay("::1", closed_v6_port())
    try:
        with socket.create_connection(("127.0.0.1", relay.port), 5) as client:
            client.sendall(b"GET /x HTTP/1.0\r\n\r\n")
            try:
                answer = client.recv(100)
            except ConnectionResetError:
                answer = b""
        assert answer == b""  # what a client of a dead launcher sees too
        with pytest.raises(OSError):  # URLError, a reset or a remote disconnect
            get(relay.address)
    finally:
        relay.close()


def test_horovod_is_pointed_at_an_ipv4_launcher_directly_and_at_an_ipv6_one_through_the_relay(
    upstreams: Callable[[str], Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    # setenv (not delenv, which records nothing for an unset name): the test's end removes what
    # point() writes, so later tests' subprocesses do not inherit a dead rendezvous.
    monkeypatch.setenv(env.HOROVOD_RENDEZVOUS_ADDR, "unset")
    monkeypatch.setenv(env.HOROVOD_RENDEZVOUS_PORT, "0")
    first, second = upstreams("first"), upstreams("second")
    horovod = ipv6.HorovodRendezvous()
    try:
        assert horovod.point("10.0.0.1:1234") == ("10.0.0.1", 1234)
        assert horovod.relay is None
        assert os.environ[env.HOROVOD_RENDEZVOUS_ADDR] == "10.0.0.1"
        assert os.environ[env.HOROVOD_RENDEZVOUS_PORT] == "1234"

        host, port = horovod.point(f"[::1]:{first.port}")
        relay = horovod.relay
        assert relay is not None and (host, port) == ("127.0.0.1", relay.port)
        assert os.environ[env.HOROVOD_RENDEZVOUS_ADDR] == "127.0.0.1"
        assert os.environ[env.HOROVOD_RENDEZVOUS_PORT] == str(relay.port)
        assert get(protocol.host_port(host, port)) == b"first"

        # A takeover by a launcher at another IPv6 address re-points the same relay.
        assert horovod.point(f"[::1]:{second.port}") == (host, port)
        assert horovod.relay is relay
        assert get(protocol.host_port(host, port)) == b"second"
    finally:
        horovod.close()


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
    launcher_port = closed_v6_port()  # the route is all that counts; nothing is sent
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
        with pytest.raises(Exception, match="::1"):
            launcher_rendezvous._notify_any_family(forged, 9, HostUpdateResult.added, 5)
        assert [u[0] for u in manager.updates] == [7, 8]
    finally:
        service.shutdown()


def test_the_launcher_s_rendezvous_answers_over_ipv4_and_ipv6_and_through_a_relay() -> None:
    service = RendezvousService(ReadinessBoard(lambda: None), wait_timeout=1.0)
    port = service.start()
    relay = ipv6.Relay("::1", port)
    try:
        # Gloo's key-value scopes, as Horovod's store uses them, over each way in.
        for address in (f"127.0.0.1:{port}", f"[::1]:{port}", relay.address):
            key = f"/global/{address.replace(':', '_')}"
            with pytest.raises(urllib.error.HTTPError):  # no such key yet: 404
                get(address, key)
            get(address, key, data=b"value")
            assert get(address, key) == b"value"
    finally:
        relay.close()
        service.stop()


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
