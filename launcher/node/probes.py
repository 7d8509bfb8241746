"""Can this node reach its peers? A TCP listener that every agent runs, and a prober that
connects to every other member's listener once a second.

A node that reaches etcd but not one of its peers would be kept in every re-formed ring and fail
Gloo's connect (or hang in its collectives) again and again. Each agent therefore listens on a
probe port (advertised in its ``members/<node>`` record) and connects to every other member's,
and writes the members it cannot reach into its record; the launcher's policy leaves the
unreachable side out of the ring until the probes show both sides reach each other again.

A peer counts as unreachable after FAILURES_TO_MARK failed probes in a row, and reachable again
after SUCCESSES_TO_CLEAR successful ones, so that one lost packet does not re-form the ring.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final

log = logging.getLogger(__name__)

#: Seconds between two rounds of probes, and the longest a connect may take.
PROBE_INTERVAL: Final = 1.0
PROBE_TIMEOUT: Final = 1.0
FAILURES_TO_MARK: Final = 2
SUCCESSES_TO_CLEAR: Final = 2

#: A peer to probe: its address and probe port.
Target = tuple[str, int]


class ProbeListener:
    """Accepts TCP connections on ``host`` (any free port) and closes them at once."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self._socket.listen(64)
        self._socket.settimeout(0.5)
        self.port = int(self._socket.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="probe-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.close()

    def close(self) -> None:
        """Stop accepting and join the thread (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close()


def probe(targets: Mapping[str, Target], timeout: float = PROBE_TIMEOUT) -> frozenset[str]:
    """Connect to every target at once; the names of those that did not accept within
    ``timeout`` seconds (refused, unreachable or silent)."""
    failed: set[str] = set()
    pending: dict[socket.socket, str] = {}
    with selectors.DefaultSelector() as selector:
        for name, (host, port) in targets.items():
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((host, port))
            if code not in (0, errno.EINPROGRESS):
                failed.add(name)
                sock.close()
                continue
            pending[sock] = name
            selector.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(remaining):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                name = pending.pop(ready)
                selector.unregister(ready)
                if ready.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    failed.add(name)
                ready.close()
        for sock, name in pending.items():
            failed.add(name)
            sock.close()
    return frozenset(failed)


class Prober:
    """Probes the current targets every PROBE_INTERVAL on a thread of its own and calls
    ``on_change`` with the peers it deems unreachable whenever that set changes."""

    def __init__(self, on_change: Callable[[frozenset[str]], None]) -> None:
        self._on_change = on_change
        self._targets: Mapping[str, Target] = {}
        self._failures: dict[str, int] = {}
        self._successes: dict[str, int] = {}
        self._unreachable: frozenset[str] = frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_targets(self, targets: Mapping[str, Target]) -> None:
        """Probe these peers from the next round on (replaces the previous set)."""
        self._targets = dict(targets)

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL):
            targets = self._targets
            before = self._unreachable
            unreachable = self.judge(targets, probe(targets))
            if unreachable != before:
                try:
                    self._on_change(unreachable)
                except Exception:
                    log.exception("the prober's change callback failed")

    def judge(self, targets: Mapping[str, Target], failed: frozenset[str]) -> frozenset[str]:
        """The peers deemed unreachable after one round with these failures (see the module
        docstring for the counts); peers no longer probed are forgotten."""
        for name in list(self._failures):
            if name not in targets:
                self._failures.pop(name, None)
                self._successes.pop(name, None)
        unreachable = set(self._unreachable & targets.keys())
        for name in targets:
            if name in failed:
                self._failures[name] = self._failures.get(name, 0) + 1
                self._successes[name] = 0
                if self._failures[name] >= FAILURES_TO_MARK:
                    unreachable.add(name)
            else:
                self._successes[name] = self._successes.get(name, 0) + 1
                self._failures[name] = 0
                if self._successes[name] >= SUCCESSES_TO_CLEAR:
                    unreachable.discard(name)
        self._unreachable = frozenset(unreachable)
        return self._unreachable

    def close(self) -> None:
        """Stop probing and join the thread (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._thread.join(timeout=PROBE_INTERVAL + PROBE_TIMEOUT + 1.0)
