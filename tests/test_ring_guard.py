"""The ring guard's choice of sockets: Gloo's connections of the latest ``hvd.init()`` only.

Real sockets of this test process stand in for everything: a "script" connection made before
and one made after a simulated init window, Gloo-like connections made inside it (both ends, as
in a Gloo pair where one side connects and the other accepts), one to an excluded port (the
rendezvous) and one closed again inside the window. The last tests run the guard itself against
a real etcd.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator

import pytest

from elastic_allreduce.bootstrap.ring_guard import RingGuard
from elastic_allreduce.bootstrap.sockets import (
    GlooSockets,
    own_sockets,
    shutdown_sockets,
    tcp_sockets,
)
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import EpochCause, Ring, RingState
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from tests.conftest import fresh_job_id

SLOT = "node-a.0"


class Sockets:
    """Listeners and connections on loopback, all closed at the end of a test."""

    def __init__(self) -> None:
        self.opened: list[socket.socket] = []

    def listener(self, family: socket.AddressFamily = socket.AF_INET) -> socket.socket:
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        server.listen(8)
        self.opened.append(server)
        return server

    def connect(self, server: socket.socket) -> socket.socket:
        """A connection to ``server`` (its accepted end is left for :meth:`accept`)."""
        client = socket.create_connection(server.getsockname()[:2], timeout=5)
        self.opened.append(client)
        return client

    def accept(self, server: socket.socket) -> socket.socket:
        accepted, _ = server.accept()
        accepted.settimeout(5)
        self.opened.append(accepted)
        return accepted

    def pair(self, server: socket.socket) -> tuple[socket.socket, socket.socket]:
        """A connection to ``server``: (the connecting end, the accepted end)."""
        client = self.connect(server)
        return client, self.accept(server)

    def close(self) -> None:
        for sock in self.opened:
            sock.close()


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    made = Sockets()
    yield made
    made.close()


def inode(sock: socket.socket) -> int:
    """The inode /proc names one of this process's sockets by."""
    (found,) = [number for number, fd in own_sockets().items() if fd == sock.fileno()]
    return found


def fds(*socks: socket.socket) -> list[int]:
    return sorted(sock.fileno() for sock in socks)


def echoes(a: socket.socket, b: socket.socket) -> bool:
    """Whether a line sent on ``a`` arrives at ``b``, and one sent back arrives at ``a``."""
    try:
        a.sendall(b"ping\n")
        if b.recv(5) != b"ping\n":
            return False
        b.sendall(b"pong\n")
        return a.recv(5) == b"pong\n"
    except OSError:
        return False


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_the_socket_tables_see_this_process_s_sockets(sockets: Sockets) -> None:
    server = sockets.listener()
    client, accepted = sockets.pair(server)
    table = tcp_sockets()
    mine = own_sockets()
    for sock in (server, client, accepted):
        assert mine[inode(sock)] == sock.fileno()
    assert not table[inode(server)].established  # listening
    assert table[inode(client)].established
    assert table[inode(client)].remote_port == server.getsockname()[1]
    assert table[inode(accepted)].local_port == server.getsockname()[1]


def test_only_connections_opened_during_init_are_gloo_s(sockets: Sockets) -> None:
    storage = sockets.listener()  # a server the script talks to (object storage, metrics)
    peer = sockets.listener()  # a Gloo peer's listener (another process's, in a real job)
    rendezvous = sockets.listener()
    script_before = sockets.pair(storage)
    gloo = GlooSockets({rendezvous.getsockname()[1]})

    before = gloo.begin()
    connected, accepted = sockets.pair(peer)  # one Gloo pair connects, the other accepts
    to_rendezvous = sockets.connect(rendezvous)  # Gloo's HTTP store, the progress beacon
    brief = sockets.pair(storage)
    for sock in brief:  # opened and closed again while init ran: gone at its end
        sock.close()
    recorded = gloo.end(before)

    at_rendezvous = sockets.accept(rendezvous)  # the rendezvous server's end: not this process's
    script_after = sockets.pair(storage)
    assert recorded == 2
    descriptors, others = gloo.established()
    assert sorted(descriptors) == fds(connected, accepted)
    assert others >= len((*script_before, *script_after, to_rendezvous, at_rendezvous))

    assert shutdown_sockets(descriptors) == 2
    assert connected.recv(1) == b""  # cut: the blocked side of a Gloo pair wakes up
    for a, b in (script_before, script_after, (to_rendezvous, at_rendezvous)):
        assert echoes(a, b)
    assert gloo.established()[0] == {}  # no longer established after the shutdown


def test_a_descriptor_reused_since_it_was_listed_is_not_shut_down(sockets: Sockets) -> None:
    """Between the listing and the shutdown Horovod may close a Gloo connection (its reset) and
    the process reuse the number for another socket (an HTTP request of its store, the relay's
    connection): that one must stay."""
    peer, storage = sockets.listener(), sockets.listener()
    gloo = GlooSockets(())
    before = gloo.begin()
    connected, accepted = sockets.pair(peer)
    gloo.end(before)
    descriptors, _ = gloo.established()
    assert sorted(descriptors) == fds(connected, accepted)
    other = sockets.pair(storage)
    os.dup2(other[0].fileno(), connected.fileno())  # the number now holds another socket
    assert shutdown_sockets(descriptors) == 1  # the accepted end only
    assert echoes(connected, other[1])  # the socket now at the listed number was left alone
    assert accepted.recv(1) == b""


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_connections_are_seen_too(sockets: Sockets) -> None:
    storage = sockets.listener(socket.AF_INET6)
    peer = sockets.listener(socket.AF_INET6)
    script = sockets.pair(storage)
    gloo = GlooSockets(())
    before = gloo.begin()
    connected, accepted = sockets.pair(peer)
    assert gloo.end(before) == 2
    assert sorted(gloo.established()[0]) == fds(connected, accepted)
    assert script[0].fileno() not in gloo.established()[0]


def test_a_reinit_replaces_the_closed_connections_and_a_repeated_init_keeps_them(
    sockets: Sockets,
) -> None:
    peer = sockets.listener()
    gloo = GlooSockets(())
    before = gloo.begin()
    first = sockets.pair(peer)
    assert gloo.end(before) == 2
    # hvd.init() again without a shutdown: Horovod connects nothing, Gloo's mesh stays.
    assert gloo.end(gloo.begin()) == 2
    assert sorted(gloo.established()[0]) == fds(*first)
    # A reset: shutdown() closes the mesh, init() connects a new one.
    for sock in first:
        sock.close()
    before = gloo.begin()
    second = sockets.pair(peer)
    assert gloo.end(before) == 2
    assert sorted(gloo.established()[0]) == fds(*second)


# -- the guard, on a real etcd ----------------------------------------------------------------


@pytest.fixture
def store(etcd_server: EmbeddedEtcd) -> Iterator[EtcdStore]:
    made = EtcdStore(etcd_server.endpoints_text, fresh_job_id("guard"))
    yield made
    made.close()


def ring(epoch: int, state: RingState, cause: EpochCause, waiting: tuple[str, ...]) -> Ring:
    return Ring(epoch, (SLOT, "node-b.0"), state, "127.0.0.1:1", waiting, cause)


def wait_for_eof(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` reads end-of-file within ``seconds`` (its peer was shut down)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


@pytest.mark.timeout(60)
def test_the_guard_cuts_gloo_s_connections_after_a_failure_only(
    sockets: Sockets, store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="elastic_allreduce.bootstrap")
    storage, peer = sockets.listener(), sockets.listener()
    script = sockets.pair(storage)
    # The peers' ends of Gloo's connections: sockets made before the window, so only this
    # process's ends (accepted inside it) are Gloo's, as in a real job.
    peers = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
    sockets.opened += peers
    gloo = GlooSockets(())
    before = gloo.begin()
    for end in peers:
        end.connect(peer.getsockname())
        sockets.accept(peer)
    assert gloo.end(before) == 2
    guard = RingGuard(store, SLOT, 1, gloo)
    guard.start()
    try:
        store.put(keys.RING, ring(1, RingState.RUNNING, EpochCause.START, ()).to_json())
        # A resize never interrupts the members.
        store.put(keys.RING, ring(2, RingState.FORMING, EpochCause.RESIZE, (SLOT,)).to_json())
        assert not wait_for_eof(peers[0], 1.0)
        store.put(keys.RING, ring(3, RingState.FORMING, EpochCause.FAILURE, (SLOT,)).to_json())
        assert all(wait_for_eof(end, 10.0) for end in peers)
    finally:
        guard.stop()
    assert echoes(*script)
    deadline = time.monotonic() + 5
    while not any("Gloo connections" in m for m in caplog.messages):
        assert time.monotonic() < deadline, caplog.messages
        time.sleep(0.05)
    (line,) = [m for m in caplog.messages if "Gloo connections" in m]
    assert f"slot {SLOT}: epoch 3 failed; shut down 2 Gloo connections of epoch 1" in line


def test_the_guard_leaves_a_newer_epoch_s_connections_alone(
    sockets: Sockets, store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure event that arrives after the process already re-formed (the stored ring is
    running again) must not cut the connections its new ``hvd.init()`` made."""
    caplog.set_level(logging.INFO, logger="elastic_allreduce.bootstrap")
    peer = sockets.listener()
    far_end = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sockets.opened.append(far_end)
    gloo = GlooSockets(())
    before = gloo.begin()
    far_end.connect(peer.getsockname())
    near_end = sockets.accept(peer)
    assert gloo.end(before) == 1
    store.put(keys.RING, ring(2, RingState.RUNNING, EpochCause.FAILURE, ()).to_json())
    guard = RingGuard(store, SLOT, 1, gloo)  # not started: events are handed in below
    try:
        guard._on_ring(ring(2, RingState.FORMING, EpochCause.FAILURE, (SLOT,)))
    finally:
        guard.stop()
    assert echoes(far_end, near_end)
    assert any("has already left epoch 1 (nothing to shut down)" in m for m in caplog.messages)
    # The same event while the stored ring still waits for this slot: cut.
    store.put(keys.RING, ring(3, RingState.FORMING, EpochCause.FAILURE, (SLOT,)).to_json())
    guard = RingGuard(store, SLOT, 2, gloo)
    try:
        guard._on_ring(ring(3, RingState.FORMING, EpochCause.FAILURE, (SLOT,)))
    finally:
        guard.stop()
    assert wait_for_eof(far_end, 5.0)
