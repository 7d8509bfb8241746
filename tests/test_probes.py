"""Peer probes (launcher/node/probes.py): real sockets on loopback, and the judge's counts."""

from __future__ import annotations

import socket

from launcher.node.probes import FAILURES_TO_MARK, SUCCESSES_TO_CLEAR, ProbeListener, Prober, probe


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_listening_peer_is_reached_and_a_closed_port_is_not() -> None:
    listener = ProbeListener("127.0.0.1")
    try:
        failed = probe({"up": ("127.0.0.1", listener.port), "down": ("127.0.0.1", closed_port())})
        assert failed == {"down"}
        assert probe({}) == frozenset()
    finally:
        listener.close()
    assert probe({"up": ("127.0.0.1", listener.port)}) == {"up"}  # closed with its listener


def test_a_silent_address_times_out_as_unreachable() -> None:
    # 192.0.2.0/24 (TEST-NET-1) is never routed: the connect gets no answer, or none is allowed.
    assert probe({"far": ("192.0.2.1", 9)}, timeout=0.3) == {"far"}


def test_one_lost_probe_is_not_enough_and_recovery_needs_two_successes() -> None:
    assert (FAILURES_TO_MARK, SUCCESSES_TO_CLEAR) == (2, 2)
    prober = Prober(lambda _: None)
    targets = {"a": ("10.0.0.1", 1), "b": ("10.0.0.2", 1)}
    assert prober.judge(targets, frozenset({"a"})) == frozenset()
    assert prober.judge(targets, frozenset()) == frozenset()  # the count starts again
    assert prober.judge(targets, frozenset({"a"})) == frozenset()
    assert prober.judge(targets, frozenset({"a"})) == {"a"}
    assert prober.judge(targets, frozenset()) == {"a"}  # one success is not enough
    assert prober.judge(targets, frozenset()) == frozenset()
    # A peer no longer probed (it left) is forgotten.
    prober.judge(targets, frozenset({"b"}))
    assert prober.judge(targets, frozenset({"b"})) == {"b"}
    assert prober.judge({"a": targets["a"]}, frozenset()) == frozenset()


def test_probes_work_over_ipv6() -> None:
    listener = ProbeListener("::1")
    try:
        assert probe({"v6": ("::1", listener.port)}) == frozenset()
    finally:
        listener.close()
