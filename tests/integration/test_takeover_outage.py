"""A standby that takes a job over just as etcd comes back from an outage (issue #12, found by
the soak): etcd let every lease expire while it was away, so the agents' member keys and the
processes' keys are gone until they register again. The standby waits for the ring's nodes
(RingPolicy.adopt) instead of taking them for dead: it starts no node of its own (--workers 0),
stops none, and the ranks go on training in the same epoch, from the same state."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import fresh_job_id
from tests.integration.harness import ELASTIC_RUN, UNTIL_SCRIPT, Event, Job, watch_process
from tests.integration.test_takeover import FLAGS, start_standby

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Longer than the job's lease TTL (3 s): etcd revokes those leases when it runs again.
OUTAGE = 10.0
#: The standby's own lease outlives the outage (in the soak: a standby started as etcd came
#: back); the job it adopts keeps its stored TTL.
STANDBY_TTL = ("--lease-ttl", "30", "--stuck-timeout", "35", "--resize-timeout", "60")


class PausableRelay:
    """A TCP relay to etcd for some of the job's processes. Paused, it drops their
    connections and leaves new ones unanswered: etcd stays away for them while it is back for
    the others."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        self._open.wait()
        try:
            upstream = socket.create_connection(self._target, timeout=5.0)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets += [client, upstream]
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def pause(self) -> None:
        self._open.clear()
        with self._lock:
            dropped, self._sockets = self._sockets, []
        for sock in dropped:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._server.close()
        self.pause()
        self._open.set()
        self._accepting.join(timeout=5.0)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for sock in (source, sink):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def test_a_standby_taking_over_as_etcd_returns_waits_for_the_ring_and_starts_no_node(
    private_etcd: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    stop_file = tmp_path / "stop"
    script_args = (*("--stop-file", str(stop_file), "--commit-every", "5", "--step-delay", "0.03"),)
    relays = [PausableRelay(private_etcd.host, private_etcd.client_port) for _ in range(2)]
    try:
        check(private_etcd, *relays, jobs, stop_file=stop_file, script_args=script_args)
    finally:
        for relay in relays:
            relay.close()


def check(
    etcd: EmbeddedEtcd,
    leaders: PausableRelay,
    agents: PausableRelay,
    jobs: list[Job],
    *,
    stop_file: Path,
    script_args: tuple[str, ...],
) -> None:
    job_id = fresh_job_id("it")
    leader = watch_process(
        [
            *(ELASTIC_RUN, "--etcd", leaders.endpoint, "--job-id", job_id, *FLAGS),
            *("--", "python", UNTIL_SCRIPT, *script_args),
        ],
        etcd,
        job_id,
    )
    jobs.append(leader)
    leader.wait_for(lambda: any("started nodes" in line for line in leader.lines), 60, "leader")
    standby = start_standby(etcd, leader, (*FLAGS, *STANDBY_TTL), script_args)
    jobs.append(standby)
    join = [ELASTIC_RUN, "join", "--etcd", agents.endpoint, "--job-id", job_id]
    nodes = [watch_process(join, etcd, job_id) for _ in range(2)]
    jobs.extend(nodes)

    def commits() -> list[Event]:
        return [e for node in nodes for e in node.commits(2)]

    nodes[0].wait_for(lambda: len(commits()) >= 10, 120, "commits at size 2")
    epochs = {e.epoch for e in commits()}
    slots = {e.slot for e in commits()}
    pids = {slot: leader.pid(keys.proc(slot)) for slot in slots}

    # etcd stalls for longer than the job's lease TTL: when it runs again it revokes every
    # lease of the job at once (the standby's lives on: a longer TTL). The leader and the
    # nodes stay cut off a while longer, so that the standby takes the leader key and adopts
    # the job before they register again (in the soak: a standby started as etcd came back,
    # while the others' calls still waited out their timeouts).
    os.kill(etcd.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        nodes[0].wait_for(lambda: time.monotonic() - stopped_at >= OUTAGE, OUTAGE + 5, "outage")
        leaders.pause()
        agents.pause()
    finally:
        os.kill(etcd.pid, signal.SIGCONT)
    try:
        standby.wait_for(
            lambda: any("took over ring epoch" in line for line in standby.lines),
            60,
            "the standby taking over",
        )
    finally:
        agents.resume()
    resumed_at = time.monotonic()
    nodes[0].wait_for(
        lambda: {e.slot for e in commits() if e.at > resumed_at + 10.0} == slots,
        60,
        "both ranks committing after the takeover",
    )
    leaders.resume()
    assert leader.finish(timeout=30) != 0, leader.tail()  # it stops without writing
    assert any("no longer leads the job" in line for line in leader.lines), leader.tail()
    log = "\n".join(standby.lines[-60:]) + "".join(
        f"\n--- node {i}:\n" + "\n".join(node.lines[-80:]) for i, node in enumerate(nodes)
    )
    assert not any("started nodes ['" in line for line in standby.lines), log
    assert not any("stopping node" in line for line in standby.lines), log
    assert not any("and 0 nodes" in line for line in standby.lines), log
    assert {e.epoch for e in commits()} == epochs, log  # no new ring, no rollback
    for slot in slots:
        assert leader.pid(keys.proc(slot)) == pids[slot], f"{slot} was restarted:\n{log}"
    assert any("for them to register again" in line for line in standby.lines), (
        "the ring's nodes were back before the takeover: the test did not test what it should\n"
        + log
    )

    stop_file.touch()
    assert standby.finish(timeout=120) == 0, standby.tail()
    for node in nodes:
        assert node.finish(timeout=60) == 0, node.tail()
    done = [e for node in nodes for e in node.done()]
    assert {e.slot for e in done} == slots
    assert len({e.data["step"] for e in done}) == 1, [e.data for e in done]
    assert len({e.data["checksum"] for e in done}) == 1, [e.data for e in done]
