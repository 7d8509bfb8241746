"""The relay a training process reaches the launcher's rendezvous through
(elastic_allreduce/rendezvous/relay.py): it adds the launcher's token to each request, pipes the
connection both ways, follows a launcher that takes over, and reaches IPv6 launchers for
Horovod's IPv4-only clients. Real sockets on loopback; the launcher's rendezvous is the real one
where its answers matter."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from horovod.runner.common.util import secret
from horovod.runner.common.util.network import AckResponse, Wire
from horovod.runner.elastic.worker import HostUpdateResult

from elastic_allreduce import env
from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous import protocol, relay
from elastic_allreduce.rendezvous.relay import HorovodRendezvous, Relay, with_token
from launcher.leader import rendezvous as launcher_rendezvous
from launcher.leader.rendezvous import ReadinessBoard, RendezvousService
from tests.test_ring_guard import ipv6_loopback

pytestmark = pytest.mark.timeout(60)

needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Upstream:
    """An HTTP server on ``host``: GET answers its name and the token it was sent
    (``name token``), PUT echoes the body."""

    def __init__(self, name: str, host: str = "::1") -> None:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                tokens = self.headers.get_all(protocol.TOKEN_HEADER) or []
                self._answer(f"{name} {','.join(tokens)}".encode())

            def do_PUT(self) -> None:
                self._answer(self.rfile.read(int(self.headers["Content-Length"])))

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self.server = Server((host, 0), Handler)
        self.host = host
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstreams() -> Iterator[Callable[..., Upstream]]:
    made: list[Upstream] = []

    def make(name: str, host: str = "::1") -> Upstream:
        made.append(Upstream(name, host))
        return made[-1]

    yield make
    for upstream in made:
        upstream.close()


def get(
    address: str, path: str = "/x", data: bytes | None = None, headers: dict[str, str] | None = None
) -> bytes:
    request = urllib.request.Request(f"http://{address}{path}", data=data, headers=headers or {})
    if data is not None:
        request.get_method = lambda: "PUT"
    with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310 - http://
        body: bytes = reply.read()
        return body


def closed_port(host: str = "::1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def pipe_threads() -> int:
    return sum(t.name.startswith("rendezvous-relay-") for t in threading.enumerate())


# -- the head rewrite (pure) --------------------------------------------------------------------


def test_the_token_is_added_after_the_request_line_and_the_client_s_own_is_replaced() -> None:
    head = b"PUT /global/k HTTP/1.1\r\nHost: x\r\nx-elastic-allreduce-token: mine\r\n\r\n"
    assert with_token(head, "T") == (
        b"PUT /global/k HTTP/1.1\r\nHost: x\r\nX-Elastic-Allreduce-Token: T\r\n\r\n"
    )
    assert with_token(b"GET / HTTP/1.0\r\n\r\n", "T") == (
        b"GET / HTTP/1.0\r\nX-Elastic-Allreduce-Token: T\r\n\r\n"
    )
    # Without a token (a launcher that required none) a client's own is still removed.
    assert with_token(head, None) == b"PUT /global/k HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "head", [b"GET / HTTP/1.0\r\n", b"GARBAGE\r\n\r\n", b"GET /a b HTTP/1.0\r\n\r\n"]
)
def test_what_is_not_a_request_head_is_refused(head: bytes) -> None:
    with pytest.raises(ProtocolError):
        with_token(head, "T")


# -- the relay ----------------------------------------------------------------------------------


def test_the_relay_adds_the_token_and_pipes_http_both_ways(
    upstreams: Callable[..., Upstream],
) -> None:
    launcher = upstreams("launcher", "127.0.0.1")
    piped = Relay("127.0.0.1", launcher.port, "secret")
    try:
        assert piped.address == f"127.0.0.1:{piped.port}"
        assert get(piped.address) == b"launcher secret"
        # A client's own token header does not get through: the relay's replaces it.
        assert get(piped.address, headers={protocol.TOKEN_HEADER: "forged"}) == b"launcher secret"
        body = os.urandom(3 * 1024 * 1024)  # larger than any socket buffer, both ways
        assert get(piped.address, data=body) == body
        # Each connection's threads end with it: nothing is left running, nothing polls.
        wait_until(lambda: pipe_threads() == 1, 5, "only the accepting thread")
    finally:
        piped.close()
    assert pipe_threads() == 0
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", piped.port), 2):
        pass


@needs_ipv6
def test_the_relay_reaches_an_ipv6_launcher_for_ipv4_only_clients(
    upstreams: Callable[..., Upstream],
) -> None:
    launcher = upstreams("launcher", "::1")
    piped = Relay("::1", launcher.port, "t6")
    try:
        assert get(piped.address) == b"launcher t6"
    finally:
        piped.close()


def test_a_retargeted_relay_sends_new_connections_to_the_new_launcher_with_its_token(
    upstreams: Callable[..., Upstream],
) -> None:
    old, new = upstreams("old", "127.0.0.1"), upstreams("new", "127.0.0.1")
    piped = Relay("127.0.0.1", old.port, "old-token")
    try:
        assert get(piped.address) == b"old old-token"
        piped.retarget("127.0.0.1", new.port, "new-token")
        assert piped.target == ("127.0.0.1", new.port)
        assert get(piped.address) == b"new new-token"
    finally:
        piped.close()


def test_a_relay_that_cannot_connect_closes_the_client_s_connection_at_once() -> None:
    piped = Relay("127.0.0.1", closed_port("127.0.0.1"), "t")
    try:
        with socket.create_connection(("127.0.0.1", piped.port), 5) as client:
            client.sendall(b"GET /x HTTP/1.0\r\n\r\n")
            try:
                answer = client.recv(100)
            except ConnectionResetError:
                answer = b""
        assert answer == b""  # what a client of a dead launcher sees too
        with pytest.raises(OSError):  # URLError, a reset or a remote disconnect
            get(piped.address)
    finally:
        piped.close()


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"GET /rank_and_size/n0.0:0 HTTP/1.1\r\nHost: x\r\n\r\n", True),
        (b"GET /rank_and_size HTTP/1.1\r\n\r\n", True),
        (b"GET /global/0 HTTP/1.1\r\n\r\n", False),
        (b"GET /elastic_ready/n0.0 HTTP/1.0\r\n\r\n", False),
        (b"PUT /progress/n0.0 HTTP/1.0\r\n\r\n", False),
        (b"GET /x/rank_and_size HTTP/1.0\r\n\r\n", False),
        (b"GARBAGE\r\n\r\n", False),
    ],
)
def test_only_horovod_s_wait_for_its_ranks_is_held_for_a_launcher(
    head: bytes, expected: bool
) -> None:
    assert relay.held(head) is expected


def _ask_in_background(address: str, path: str) -> tuple[threading.Thread, list[object]]:
    """GET ``path`` through the relay in a thread: its answer (bytes) or error lands in the
    list."""
    outcome: list[object] = []

    def ask() -> None:
        try:
            outcome.append(get(address, path))
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, outcome


def test_horovod_s_wait_for_its_ranks_waits_in_the_relay_for_the_next_launcher(
    upstreams: Callable[..., Upstream],
) -> None:
    """Issue #12 (the soak): a survivor waiting to re-form when its launcher is SIGKILLed sends
    ``rank_and_size`` again from Horovod's C++ store, which tries three times 0.5 s apart and
    then aborts the process; the relay holds that request until a launcher answers."""
    piped = Relay("127.0.0.1", closed_port("127.0.0.1"), "old-token")
    try:
        thread, outcome = _ask_in_background(piped.address, "/rank_and_size/n0.0:0")
        thread.join(1.5)  # three tries of Horovod's, and longer than RETRY_S
        assert outcome == []  # still waiting, not closed unanswered
        successor = upstreams("successor", "127.0.0.1")
        piped.retarget("127.0.0.1", successor.port, "new-token")
        thread.join(10)
        assert outcome == [b"successor new-token"]  # the successor's token, not the old one
    finally:
        piped.close()


def test_a_held_request_is_closed_unanswered_when_no_launcher_comes_or_the_relay_closes() -> None:
    patient = Relay("127.0.0.1", closed_port("127.0.0.1"), "t", hold_s=0.3)
    try:
        thread, outcome = _ask_in_background(patient.address, "/rank_and_size/n0.0:0")
        thread.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], OSError), outcome
    finally:
        patient.close()
    closing = Relay("127.0.0.1", closed_port("127.0.0.1"), "t")
    thread, outcome = _ask_in_background(closing.address, "/rank_and_size/n0.0:0")
    thread.join(0.5)
    assert outcome == []
    closing.close()
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], OSError), outcome


def test_a_connection_that_sends_no_request_head_is_dropped_unforwarded(
    upstreams: Callable[..., Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "MAX_HEAD", 1024)
    launcher = upstreams("launcher", "127.0.0.1")
    piped = Relay("127.0.0.1", launcher.port, "t")
    try:
        with socket.create_connection(("127.0.0.1", piped.port), 5) as client:
            client.sendall(b"GET /x HTTP/1.0\r\nX: " + b"y" * 4096)
            try:
                answer = client.recv(100)
            except ConnectionResetError:
                answer = b""
        assert answer == b""
        assert get(piped.address) == b"launcher t"  # the relay serves on
    finally:
        piped.close()


def test_every_client_of_a_process_is_pointed_at_the_launcher_through_the_relay(
    upstreams: Callable[..., Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    # setenv (not delenv, which records nothing for an unset name): the test's end removes what
    # point() writes, so later tests' subprocesses do not inherit a dead rendezvous.
    monkeypatch.setenv(env.HOROVOD_RENDEZVOUS_ADDR, "unset")
    monkeypatch.setenv(env.HOROVOD_RENDEZVOUS_PORT, "0")
    first, second = upstreams("first", "127.0.0.1"), upstreams("second", "127.0.0.1")
    horovod = HorovodRendezvous()
    try:
        assert horovod.relay is None
        host, port = horovod.point(f"127.0.0.1:{first.port}", "one")
        piped = horovod.relay
        assert piped is not None and (host, port) == ("127.0.0.1", piped.port)
        assert os.environ[env.HOROVOD_RENDEZVOUS_ADDR] == "127.0.0.1"
        assert os.environ[env.HOROVOD_RENDEZVOUS_PORT] == str(piped.port)
        assert get(protocol.host_port(host, port)) == b"first one"

        # A takeover by a launcher at another address re-points the same relay.
        assert horovod.point(f"127.0.0.1:{second.port}", "two") == (host, port)
        assert horovod.relay is piped
        assert get(protocol.host_port(host, port)) == b"second two"
    finally:
        horovod.close()


# -- the launcher's side: the token is required -------------------------------------------------


def test_the_launcher_s_rendezvous_answers_only_requests_with_its_token() -> None:
    board = ReadinessBoard(lambda: None)
    service = RendezvousService(board, wait_timeout=1.0)
    token = protocol.new_token()
    port = service.start("127.0.0.1", token)
    piped = Relay("127.0.0.1", port, token)
    direct = f"127.0.0.1:{port}"
    try:
        for headers in ({}, {protocol.TOKEN_HEADER: "wrong"}, {protocol.TOKEN_HEADER: ""}):
            for path, data in (
                ("/global/k", None),
                ("/global/k", b"v"),
                ("/rank_and_size/n0.0:0", None),
                ("/elastic_ready/n0.0", None),
            ):
                with pytest.raises(urllib.error.HTTPError) as refused:
                    get(direct, path, data, headers)
                assert refused.value.code == 403, (path, headers)
        # Nothing was stored, and no slot came to wait at the barrier.
        assert board.waiting() == {}
        with pytest.raises(urllib.error.HTTPError) as missing:
            get(direct, "/global/k", headers={protocol.TOKEN_HEADER: token})
        assert missing.value.code == 404
        # With the token (directly, or added by the relay) Gloo's key-value store works.
        get(direct, "/global/k", b"value", {protocol.TOKEN_HEADER: token})
        assert get(piped.address, "/global/k") == b"value"
        # Bound to the advertised address only: another loopback address is not served.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), 2).close()
    finally:
        piped.close()
        service.stop()


@needs_ipv6
def test_a_launcher_on_an_ipv6_address_serves_there_through_a_relay() -> None:
    service = RendezvousService(ReadinessBoard(lambda: None), wait_timeout=1.0)
    port = service.start("::1", "t")
    piped = Relay("::1", port, "t")
    try:
        get(piped.address, "/global/k", b"v6")
        assert get(f"[::1]:{port}", "/global/k", headers={protocol.TOKEN_HEADER: "t"}) == b"v6"
        with pytest.raises(OSError):  # not on IPv4
            socket.create_connection(("127.0.0.1", port), 2).close()
    finally:
        piped.close()
        service.stop()


def test_a_notification_s_answer_is_never_unpickled_beyond_an_acknowledgement(
    tmp_path: Path,
) -> None:
    """Whoever registers a worker address (with a key of its choice) is sent a notification;
    its answer, signed with that key, used to be unpickled by Horovod's reader. Now only
    Horovod's acknowledgement is loaded: a pickle naming anything else runs nothing."""
    marker = tmp_path / "pwned"
    key = secret.make_secret_key()

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    answers = [Payload(), AckResponse()]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        wire = Wire(key)
        for answer in answers:
            conn, _ = listener.accept()
            with conn, conn.makefile("rb") as rfile, conn.makefile("wb") as wfile:
                wire.read(rfile)  # the launcher's (signed) notification
                wire.write(answer, wfile)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    worker = protocol.WorkerAddresses((("lo", (("127.0.0.1", port),)),), key)
    try:
        with pytest.raises(ProtocolError, match=r"refused to load posix\.system"):
            launcher_rendezvous._notify_any_family(worker, 1, HostUpdateResult.added, 5)
        assert not marker.exists()
        # Horovod's real acknowledgement is accepted.
        launcher_rendezvous._notify_any_family(worker, 2, HostUpdateResult.added, 5)
    finally:
        server.join(10)
        listener.close()
    assert not marker.exists()
