"""The launcher in this process, against a real etcd and its real rendezvous over HTTP, with a
recording provisioner and nodes simulated by writing what agents and training processes write
(their records, under real leases) and asking the rendezvous what bootstraps ask. Seconds, not
the minutes of a job with TensorFlow."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from elastic_allreduce.errors import ProvisionerError
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import JobSnapshot, read_job
from elastic_allreduce.records.values import (
    EpochCause,
    ExitRecord,
    JobPhase,
    JobSettings,
    MemberRecord,
    ProcPhase,
    ProcRecord,
    RingState,
)
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.model import SlotAssignment
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, Lease
from launcher.agent import NodeTemplate
from launcher.launcher import JobResult, Launcher, LaunchSettings
from launcher.provisioners.api import Provisioner
from tests.conftest import fresh_job_id

pytestmark = pytest.mark.timeout(60)


class RecordingProvisioner(Provisioner):
    """Names nodes and records what the launcher asked; starts nothing."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.closed = False
        self._numbers = itertools.count()
        self.changed = threading.Event()

    def start_nodes(self, count: int) -> list[str]:
        if self.refuse is not None:
            raise ProvisionerError(self.refuse)
        nodes = [f"n{next(self._numbers)}" for _ in range(count)]
        self.started += nodes
        self.changed.set()
        return nodes

    def stop_node(self, node_id: str) -> None:
        self.stopped.append(node_id)

    def close(self) -> None:
        self.closed = True


class SimulatedNode:
    """One node of one slot: what its agent and its training process write to the store."""

    def __init__(self, store: EtcdStore, node: str) -> None:
        self.store = store
        self.node = node
        self.slot = keys.slot_id(node, 0)
        self.member_lease = store.grant_lease(3)
        member = MemberRecord("127.0.0.1", 1, os.getpid())
        store.put(keys.member(node), member.to_json(), lease=self.member_lease)
        self.incarnation = 0
        self.proc_lease: Lease | None = None
        self.start_process()

    def start_process(self) -> None:
        self.incarnation += 1
        self.proc_lease = self.store.grant_lease(3)
        record = ProcRecord(os.getpid(), self.incarnation, ProcPhase.STARTING, self.proc_lease.id)
        self.store.put(keys.proc(self.slot), record.to_json(), lease=self.proc_lease)

    def exit(self, code: int, *tail: str) -> None:
        """The process ended: its agent reports the exit, then revokes its lease."""
        record = ExitRecord.from_returncode(code, tail)
        self.store.put(keys.exit_(self.slot, self.incarnation), record.to_json())
        assert self.proc_lease is not None
        self.proc_lease.revoke()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - http only
        body: bytes = reply.read()
        return body


def wait_for(
    store: EtcdStore, predicate: Callable[[JobSnapshot], bool], timeout: float, what: str
) -> JobSnapshot:
    """Block on the store's watch until ``predicate`` holds for the job's snapshot."""
    watch = store.watch_prefix("")
    try:
        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            while True:
                job = read_job(store)
                if predicate(job):
                    return job
                if deadline.is_set():
                    raise AssertionError(f"timed out waiting for {what}: {job}")
                watch.get(0.5)
        finally:
            timer.cancel()
    finally:
        watch.close()


@pytest.fixture
def store(etcd_server: EmbeddedEtcd) -> Iterator[EtcdStore]:
    with EtcdStore(etcd_server.endpoints_text, fresh_job_id("inproc")) as opened:
        yield opened


def start_launcher(
    store: EtcdStore, provisioner: Provisioner, workers: int = 2, max_restarts: int = 1
) -> tuple[Future[JobResult], ThreadPoolExecutor]:
    """The launcher's ``run`` on a thread of a pool that the test's HTTP clients share."""
    settings = LaunchSettings(
        workers,
        JobSettings(1, workers, 1, max_restarts, wait_timeout=20.0, start_grace=5.0),
        NodeTemplate(
            etcd=",".join(str(endpoint) for endpoint in store.endpoints),
            job_id=store.job_id,
            nproc_per_node=1,
            command=("python", "train.py"),
        ),
    )
    pool = ThreadPoolExecutor(max_workers=4)
    return pool.submit(Launcher(settings, provisioner).run), pool


def test_the_launcher_forms_rings_restarts_a_crash_and_finishes(
    store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    provisioner = RecordingProvisioner()
    result, pool = start_launcher(store, provisioner)
    with pool:
        job = wait_for(
            store, lambda j: j.leader is not None and j.leader.record.rendezvous, 20, "a leader"
        )
        assert job.leader is not None and job.leader.record.rendezvous is not None
        rendezvous = job.leader.record.rendezvous
        assert job.config is not None and job.config.record.command == ("python", "train.py")
        assert provisioner.started == ["n0", "n1"]
        nodes = {node: SimulatedNode(store, node) for node in provisioner.started}
        store.put("procs/x", {"pid": 1})  # junk in the prefix: skipped, reported once

        # Both fresh processes wait at the barrier; they are released together in epoch 1.
        ready = {
            n.slot: pool.submit(_get, protocol.ready_url(rendezvous, n.slot))
            for n in nodes.values()
        }
        admissions = {s: protocol.decode_admission(f.result(20)) for s, f in ready.items()}
        assert {a.epoch for a in admissions.values()} == {1}
        assert sorted(a.assignment.rank for a in admissions.values()) == [0, 1]
        job = read_job(store)
        assert job.ring is not None and job.ring.record.state is RingState.RUNNING
        first = job.ring.record.slots
        survivor, victim = (nodes[first[0].split(".")[0]], nodes[first[1].split(".")[0]])

        # The victim crashes: the launcher tells its agent to run incarnation 2, and the
        # survivor's reset (rank_and_size) is answered in a failure epoch of one.
        victim.exit(1, "Traceback", "ValueError: boom")
        reset = pool.submit(
            _get,
            f"{protocol.base_url(rendezvous)}/rank_and_size/{protocol.worker_key(survivor.slot)}",
        )
        job = wait_for(
            store,
            lambda j: victim.node in j.directives and j.directives[victim.node].record.get(0) == 2,
            20,
            "the restart directive",
        )
        assert protocol.decode_assignment(reset.result(20)) == SlotAssignment(0, 1, 0, 1, 0, 1)
        job = read_job(store)
        assert job.ring is not None and job.ring.record.cause is EpochCause.FAILURE
        assert job.ring.record.slots == (survivor.slot,)

        # Incarnation 2 joins: a resize epoch appends it after the survivor (rank 0 stays).
        victim.start_process()
        rejoin = pool.submit(_get, protocol.ready_url(rendezvous, victim.slot))
        wait_for(
            store,
            lambda j: j.ring is not None and j.ring.record.cause is EpochCause.RESIZE,
            20,
            "the resize epoch",
        )
        reset = pool.submit(
            _get,
            f"{protocol.base_url(rendezvous)}/rank_and_size/{protocol.worker_key(survivor.slot)}",
        )
        assert protocol.decode_assignment(reset.result(20)).rank == 0
        assert protocol.decode_admission(rejoin.result(20)).assignment.rank == 1

        for node in nodes.values():
            node.exit(0)
        assert result.result(20) == JobResult(True, "training finished on 2 ranks")
    job = read_job(store)
    assert job.status is not None and job.status.record.phase is JobPhase.SUCCEEDED
    assert job.leader is None  # the launcher's lease was revoked at its end
    assert provisioner.closed and provisioner.stopped == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("ignoring key 'procs/x'" in m for m in messages) == 1, messages
    assert any(
        f"slot {victim.slot} crashed: exit code 1; last output: Traceback | ValueError: boom" in m
        for m in messages
    ), messages


def test_a_launcher_that_stops_on_an_error_records_the_failure(store: EtcdStore) -> None:
    provisioner = RecordingProvisioner(refuse="the cluster refused to start pods")
    result, pool = start_launcher(store, provisioner)
    with pool, pytest.raises(ProvisionerError, match="refused to start pods"):
        result.result(20)
    job = read_job(store)
    assert job.status is not None and job.status.record.phase is JobPhase.FAILED
    assert job.status.record.reason == "the launcher stopped: the cluster refused to start pods"
    assert provisioner.closed and job.leader is None
