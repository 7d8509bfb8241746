"""The ring guard under a real job: it cuts Gloo's connections after a failure, and only those.

A 3-worker job runs tests/scripts/own_connection.py, whose processes each hold two connections
of their own to an echo server run by this test (one opened before ``hvd.init()``, one after).
After a SIGKILL of rank 1 the survivors must re-form the ring quickly -- the guard shut down
their Gloo connections of the failed epoch, so no collective waits for Gloo's timeout -- and
still talk over the very same connections to the echo server. Two loads: one where the guard
is sure to act on every survivor (what it keeps is tested), one where a survivor without the
guard can stay blocked in its collective (that it recovers is tested).
"""

from __future__ import annotations

import os
import re
import signal
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import ROOT
from tests.integration.harness import Job, slot_of_rank, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(ROOT / "tests" / "scripts" / "own_connection.py")
#: Gloo's own timeout, set high so that a collective left to it would stand out; the launcher's
#: stuck-member replacement (the guard's fallback) is set above the recovery bound too.
GLOO_TIMEOUT = 60.0
RECOVERY_BOUND = GLOO_TIMEOUT / 2
GUARD_LINE = re.compile(r"shut down (\d+) Gloo connections of epoch \d+ \(kept (\d+) other")


@dataclass
class EchoServer:
    """A line echo server: greets each connection with ``conn <id>``, then answers every line
    with ``<id> <line>``; remembers which connections ended."""

    server: socketserver.ThreadingTCPServer
    opened: list[int] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True


@pytest.fixture
def echo_server() -> Iterator[EchoServer]:
    lock = threading.Lock()
    holder: list[EchoServer] = []

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            echo = holder[0]
            with lock:
                conn = len(echo.opened) + 1
                echo.opened.append(conn)
            self.wfile.write(f"conn {conn}\n".encode())
            try:
                for line in self.rfile:
                    self.wfile.write(f"{conn} ".encode() + line)
            except OSError:
                pass
            finally:
                with lock:
                    echo.closed.append(conn)

    server = _Server(("127.0.0.1", 0), Handler)
    holder.append(EchoServer(server))
    thread = threading.Thread(target=server.serve_forever, name="echo-server", daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@dataclass(frozen=True)
class Load:
    """How the job trains: the flags of tests/scripts/own_connection.py."""

    args: tuple[str, ...]
    #: Commits at size 3 to wait for before the kill.
    commits: int
    #: Whether every survivor is sure to be in the failed epoch when its guard acts.
    guards_act: bool


LOADS = {
    # Every rank sleeps after each commit, so the kill lands in that sleep: each survivor is
    # still in the failed epoch when its guard acts (else one whose own collective failed first
    # may leave before its guard looks, and what the guard keeps would not be tested).
    "idle": Load(("--steps", "24", "--commit-every", "2", "--step-delay", "0.5"), 6, True),
    # 1 MB allreduces back to back: the kill lands in a collective. Without the guard a survivor
    # can wait there until the launcher's stuck timeout (2 of 4 trials here); with it, none.
    "busy": Load(
        ("--steps", "300", "--commit-every", "10", "--step-delay", "0", "--payload", "262144"),
        9,
        False,
    ),
}


@pytest.mark.parametrize("load", LOADS.values(), ids=LOADS.keys())
def test_a_script_s_own_connections_survive_a_peer_s_sigkill(
    etcd_server: EmbeddedEtcd, jobs: list[Job], echo_server: EchoServer, load: Load
) -> None:
    job = start_job(
        etcd_server,
        *("--workers", "3", "--max-restarts", "0"),
        # The launcher's fallback for a stuck member, above the recovery bound.
        *("--stuck-timeout", "40", "--resize-timeout", "50"),
        script=SCRIPT,
        script_args=("--server", echo_server.address, *load.args),
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(GLOO_TIMEOUT))},
    )
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(3)) >= load.commits, 120, "commits at size 3")
    victim = slot_of_rank(job, 1, 3)
    survivors = {e.slot for e in job.commits(3)} - {victim}
    assert len(survivors) == 2, job.tail()
    opened = {e.slot: e.data["opened"] for e in job.commits(3)}
    killed_at = time.monotonic()
    os.kill(job.pid(keys.proc(victim)), signal.SIGKILL)
    job.wait_for(
        lambda: {e.slot for e in job.commits(2)} == survivors,
        RECOVERY_BOUND,
        "both survivors to commit at size 2",
    )

    # The survivors still talk over the connections they opened at the start: same ids.
    for slot in survivors:
        after = [e.data for e in job.commits(2) if e.slot == slot]
        assert [d["echo"] for d in after] == ["ok"] * len(after), after
        assert all(d["conns"] == opened[slot] for d in after), (opened[slot], after)
    assert len(echo_server.opened) == 6  # 3 processes x 2, never reconnected
    assert not set(echo_server.closed) & {c for s in survivors for c in opened[s]}

    # ... and they recovered at once, not after Gloo's timeout or the stuck timeout.
    for slot in survivors:
        first = min(e.at for e in job.commits(2) if e.slot == slot)
        assert first - killed_at < RECOVERY_BOUND, (slot, first - killed_at, job.tail())
    assert not any("did not leave its failed collective" in line for line in job.lines)
    cuts = [
        (int(match[1]), int(match[2]))
        for line in job.lines
        if any(f"slot {slot}:" in line for slot in survivors) and (match := GUARD_LINE.search(line))
    ]
    # Each guard that cut kept at least its process's two echo connections.
    assert all(kept >= 2 for _, kept in cuts), cuts
    if load.guards_act:
        # Both guards acted; between them they cut the survivors' live Gloo connections (the
        # second to act may find its ends already shut down by the first: they count as 0).
        assert len(cuts) == 2, job.tail()
        assert sum(gloo for gloo, _ in cuts) > 0, cuts
    assert job.finish() == 0, job.tail()
