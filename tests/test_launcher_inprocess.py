"""The launcher in this process, against a real etcd and its real rendezvous over HTTP, with a
recording provisioner and nodes simulated by writing what agents and training processes write
(their records, under real leases) and asking the rendezvous what bootstraps ask. Seconds, not
the minutes of a job with TensorFlow."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_allreduce.errors import ConfigError, ProvisionerError
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import JobSnapshot, read_job
from elastic_allreduce.records.values import (
    EpochCause,
    ExitRecord,
    JobConfig,
    JobPhase,
    JobSettings,
    LeaderRecord,
    MemberRecord,
    ProcPhase,
    ProcRecord,
    Ring,
    RingState,
)
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.model import SlotAssignment
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, Guard, Lease
from launcher.leader.job import JobResult, Launcher, LaunchSettings
from launcher.leader.leadership import LeadershipLostError
from launcher.node.agent import ask_standing
from launcher.observe.events import EventKind, read_events
from launcher.observe.observer import JobObserver, ObserverSettings
from launcher.observe.timeline import build
from launcher.provisioners.api import Provisioner
from launcher.vocabulary import NodeTemplate
from tests.conftest import fresh_job_id

pytestmark = pytest.mark.timeout(60)


class RecordingProvisioner(Provisioner):
    """Names nodes and records what the launcher asked; starts nothing."""

    def __init__(self, refuse: str | None = None, manages: frozenset[str] = frozenset()) -> None:
        self.refuse = refuse
        #: The nodes of an adopted job this provisioner says it manages (see adopt()).
        self.manages = manages
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

    def adopt(self, members: Mapping[str, MemberRecord]) -> frozenset[str]:
        return self.manages & members.keys()

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


def _get(url: str, token: str | None = None) -> bytes:
    """GET ``url``; with ``token``, as a client of the rendezvous (which requires it)."""
    headers = {} if token is None else {protocol.TOKEN_HEADER: token}
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - http only
    with urllib.request.urlopen(request, timeout=30) as reply:  # noqa: S310 - http only
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


@contextlib.contextmanager
def start_launcher(
    store: EtcdStore,
    provisioner: Provisioner,
    workers: int = 2,
    max_restarts: int = 1,
    observing: ObserverSettings | None = None,
    *,
    standby: bool = False,
    launchers: list[Launcher] | None = None,
) -> Iterator[tuple[Future[JobResult], ThreadPoolExecutor]]:
    """The launcher's ``run`` on a thread of a pool that the test's HTTP clients share;
    stopped (and the pool's threads joined) when the test leaves, whatever happened."""
    # The first ring waits for every node asked for (a loaded machine once made it form
    # without one and grow at once: an extra epoch).
    job = JobSettings(1, workers, 1, max_restarts, wait_timeout=20.0, start_grace=60.0)
    observer = JobObserver(store.job_id, job, observing) if observing else None
    settings = LaunchSettings(
        workers,
        job,
        NodeTemplate(
            etcd=",".join(str(endpoint) for endpoint in store.endpoints),
            job_id=store.job_id,
            nproc_per_node=1,
            command=("python", "train.py"),
        ),
    )
    pool = ThreadPoolExecutor(max_workers=4)
    launcher = Launcher(settings, provisioner, observer=observer, standby=standby)
    if launchers is not None:
        launchers.append(launcher)
    with pool:
        result = pool.submit(launcher.run)
        try:
            yield result, pool
        finally:
            if not result.done():
                launcher.stop("the test ended")
                launcher.board.close()


def metric(dashboard: str, name: str, **labels: str) -> float:
    """One sample of the launcher's /metrics, read over HTTP as Prometheus would."""
    text = _get(f"http://{dashboard}/metrics").decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels} in /metrics")


def test_the_launcher_forms_rings_restarts_a_crash_and_finishes(
    store: EtcdStore, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO)
    provisioner = RecordingProvisioner()
    events_file = tmp_path / "events.jsonl"
    observing = ObserverSettings(events_file=events_file, metrics_port=0)
    with start_launcher(store, provisioner, observing=observing) as (result, pool):
        job = wait_for(
            store, lambda j: j.leader is not None and j.leader.record.rendezvous, 20, "a leader"
        )
        assert job.leader is not None and job.leader.record.rendezvous is not None
        rendezvous, token = job.leader.record.rendezvous, job.leader.record.token
        dashboard = job.leader.record.dashboard
        assert dashboard is not None
        assert job.config is not None and job.config.record.command == ("python", "train.py")
        assert provisioner.changed.wait(20), "the launcher never asked for nodes"
        assert provisioner.started == ["n0", "n1"]
        nodes = {node: SimulatedNode(store, node) for node in provisioner.started}
        store.put("procs/x", {"pid": 1})  # junk in the prefix: skipped, reported once

        # Both fresh processes wait at the barrier; they are released together in epoch 1.
        ready = {
            n.slot: pool.submit(_get, protocol.ready_url(rendezvous, n.slot), token)
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
            token,
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
        rejoin = pool.submit(_get, protocol.ready_url(rendezvous, victim.slot), token)
        wait_for(
            store,
            lambda j: j.ring is not None and j.ring.record.cause is EpochCause.RESIZE,
            20,
            "the resize epoch",
        )
        reset = pool.submit(
            _get,
            f"{protocol.base_url(rendezvous)}/rank_and_size/{protocol.worker_key(survivor.slot)}",
            token,
        )
        assert protocol.decode_assignment(reset.result(20)).rank == 0
        assert protocol.decode_admission(rejoin.result(20)).assignment.rank == 1

        # What observers see now: the counters moved through the crash and the join.
        def changes(kind: str) -> float:
            return metric(dashboard, "elastic_membership_changes_total", kind=kind)

        # Joined: both first members (epoch 1), then incarnation 2 of the victim (epoch 3).
        assert (changes("Crashed"), changes("Joined"), changes("Reformed")) == (1, 3, 3)
        assert metric(dashboard, "elastic_recoveries_total", cause="failure") == 1
        assert metric(dashboard, "elastic_recoveries_total", cause="resize") == 1
        assert metric(dashboard, "elastic_reform_seconds_count", cause="resize") == 1
        assert metric(dashboard, "elastic_restarts_used") == 1
        status = json.loads(_get(f"http://{dashboard}/api/status"))
        ranks = [r["slot"] for r in status["ring"]["ranks"]]
        assert (status["ring"]["epoch"], ranks) == (3, [survivor.slot, victim.slot])
        assert metric(dashboard, "elastic_ring_epoch") == 3
        assert metric(dashboard, "elastic_ring_size") == 2
        kinds = [e["kind"] for e in json.loads(_get(f"http://{dashboard}/api/events"))]
        assert kinds == [
            "Started",
            "Joined",
            "Reformed",
            "Crashed",
            "Reformed",
            "Joined",
            "Reformed",
        ], kinds

        for node in nodes.values():
            node.exit(0)
        assert result.result(20) == JobResult(True, "training finished on 2 ranks")
    job = read_job(store)
    assert job.status is not None and job.status.record.phase is JobPhase.SUCCEEDED
    assert job.leader is None  # the launcher's lease was revoked at its end
    events, skipped = read_events(events_file.read_text().splitlines())
    assert not skipped and events[-1].kind is EventKind.FINISHED and events[-1].succeeded
    assert [epoch for _, _, epoch, _ in build(events).epochs] == [1, 2, 3]
    assert provisioner.closed and provisioner.stopped == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("ignoring key 'procs/x'" in m for m in messages) == 1, messages
    assert any(
        f"slot {victim.slot} crashed: exit code 1; last output: Traceback | ValueError: boom" in m
        for m in messages
    ), messages


def test_a_launcher_that_stops_on_an_error_records_the_failure(
    store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    provisioner = RecordingProvisioner(refuse="the cluster refused to start pods")
    with (
        start_launcher(store, provisioner) as (result, _),
        pytest.raises(ProvisionerError, match="refused to start pods"),
    ):
        result.result(20)
    job = read_job(store)
    assert job.status is not None and job.status.record.phase is JobPhase.FAILED
    assert job.status.record.reason == "the launcher stopped: the cluster refused to start pods"
    assert provisioner.closed and job.leader is None
    # Where it was raised is said (a killed launcher never prints its traceback).
    (said,) = [r.getMessage() for r in caplog.records if "unexpected" in r.getMessage()]
    assert "unexpected ProvisionerError, raised at launcher/leader/job.py:" in said, said
    assert " in _lead <- launcher/leader/job.py:" in said and said.endswith(" in run"), said


def test_a_launcher_whose_lease_lapsed_while_another_took_over_writes_nothing(
    store: EtcdStore,
) -> None:
    provisioner = RecordingProvisioner()
    with start_launcher(store, provisioner) as (result, _):
        job = wait_for(store, lambda j: j.leader is not None and j.status is not None, 20, "lead")
        assert job.leader is not None and job.leader.lease is not None
        # Its lease expires (as in a SIGSTOP past the TTL) and a successor leads.
        assert store.revoke_lease(job.leader.lease)
        successor = store.grant_lease(5)
        assert store.create(keys.LEADER, {"rendezvous": None}, lease=successor) is not None
        with pytest.raises(LeadershipLostError, match="no longer leads the job"):
            result.result(20)
    after = read_job(store)
    assert after.status is not None and after.status.record.phase is JobPhase.RUNNING
    assert after.leader is not None and after.leader.lease == successor.id
    successor.revoke()


def test_a_guarded_write_needs_the_guard_key_under_that_lease(store: EtcdStore) -> None:
    mine, other = store.grant_lease(5), store.grant_lease(5)
    store.put(keys.LEADER, {"rendezvous": None}, lease=mine)
    assert store.put_guarded(
        keys.JOB_STATUS, {"phase": "running"}, guard=Guard(keys.LEADER, mine.id)
    )
    stale = Guard(keys.LEADER, other.id)
    assert store.put_guarded(keys.JOB_STATUS, {"phase": "failed"}, guard=stale) is None
    first = store.get(keys.RING)
    assert first is None
    assert store.compare_and_swap(keys.RING, 1, expected_mod_revision=0, guard=stale) is None
    assert store.get(keys.RING) is None
    status = store.get(keys.JOB_STATUS)
    assert status is not None and status.value == {"phase": "running"}
    mine.revoke()
    other.revoke()


def test_a_run_started_again_waits_out_a_dead_leader_s_lease_but_not_a_live_one(
    etcd_server: EmbeddedEtcd, store: EtcdStore
) -> None:
    """`run` finds the leader key held: a launcher whose rendezvous refuses connections is
    dead (SIGKILLed a moment ago), so its lease is waited out and the job adopted; one whose
    rendezvous answers is alive, and that is one clear ConfigError at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    dead = store.grant_lease(2)
    record = LeaderRecord(f"127.0.0.1:{closed_port}", None, "old-token")
    assert store.create(keys.LEADER, record.to_json(), lease=dead) is not None
    dead.stop_keepalive()  # as its SIGKILLed owner's: the lease lapses within 2 s
    with start_launcher(store, RecordingProvisioner()) as (result, _):
        wait_for(
            store,
            lambda j: (
                j.leader is not None
                and j.leader.lease != dead.id
                and j.leader.record.rendezvous is not None
            ),
            20,
            "the new launcher leading after the dead one's lease lapsed",
        )
        assert not result.done()
    with (
        socket.create_server(("127.0.0.1", 0)) as alive,
        EtcdStore(etcd_server.endpoints_text, fresh_job_id("inproc")) as other,
    ):
        lease = other.grant_lease(5)
        record = LeaderRecord(f"127.0.0.1:{alive.getsockname()[1]}", None, "its-token")
        assert other.create(keys.LEADER, record.to_json(), lease=lease) is not None
        with (
            start_launcher(other, RecordingProvisioner()) as (result, _),
            pytest.raises(ConfigError, match="already has a live launcher"),
        ):
            result.result(20)
        lease.revoke()


@pytest.mark.parametrize("how", ["revoked", "reported"])
def test_a_standby_whose_own_lease_lapsed_while_it_waited_takes_over_under_a_new_one(
    store: EtcdStore, how: str
) -> None:
    """etcd away past the standby's TTL lets its lease expire too; when the leader is gone it
    must still take over (it exited with 'the lease is gone' before). ``reported``: its
    keep-alive was told the lease expired while etcd still holds it (seen after a quorum loss,
    in make soak): it must not lead under a lease nobody renews."""
    leader = store.grant_lease(30)
    assert store.create(keys.LEADER, {"rendezvous": None}, lease=leader) is not None
    launchers: list[Launcher] = []
    with start_launcher(store, RecordingProvisioner(), standby=True, launchers=launchers) as (
        result,
        _,
    ):
        (standby,) = launchers
        waited = threading.Event()
        for _ in range(200):  # its lease is granted as its run() starts
            if standby.leadership.lease is not None or waited.wait(0.05):
                break
        lost = standby.leadership.lease
        assert lost is not None, "the standby never granted its lease"
        if how == "revoked":
            store.revoke_lease(lost.id)  # its lease expired while it stood by
        else:
            lost._mark_lost("the server reports it expired")  # type: ignore[attr-defined]
        leader.revoke()  # then the leader is gone
        job = wait_for(
            store,
            lambda j: j.leader is not None and j.leader.record.rendezvous is not None,
            20,
            "the standby leading",
        )
        assert job.leader is not None and job.leader.lease not in (lost.id, leader.id)
        assert not result.done()


def test_a_launcher_whose_lease_lapses_before_it_publishes_its_rendezvous_leads_again(
    store: EtcdStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd lets the new leader's lease expire between its taking the leader key and its
    writing the rendezvous address there (make soak: a takeover as etcd returned from a quorum
    loss, an etcd restart right after): it leads again under a new lease (it stopped on 'the
    lease is gone' before)."""
    lapsed: list[int] = []
    write_config = Launcher._write_config

    def then_lapse(launcher: Launcher) -> bool:
        adopted = write_config(launcher)
        lease = launcher.leadership.lease
        assert lease is not None
        lease.stop_keepalive()
        assert store.revoke_lease(lease.id)  # the leader key goes with it
        lapsed.append(lease.id)
        return adopted

    monkeypatch.setattr(Launcher, "_write_config", then_lapse)
    with start_launcher(store, RecordingProvisioner()) as (result, _):
        job = wait_for(
            store,
            lambda j: (
                j.leader is not None
                and j.leader.record.rendezvous is not None
                and j.status is not None
                and j.status.record.phase is JobPhase.RUNNING
            ),
            20,
            "the launcher leading with its rendezvous published and the job running",
        )
        assert job.leader is not None and job.leader.lease not in (None, *lapsed)
        assert lapsed and not result.done()


class LogLines(logging.Handler):
    """The launcher's log lines, and an event set when one contains ``wanted``."""

    def __init__(self, wanted: str) -> None:
        super().__init__()
        self.wanted = wanted
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.wanted in record.getMessage():
            self.seen.set()


def test_a_launcher_that_takes_over_replaces_the_lost_nodes_its_provisioner_manages(
    store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #12: the nodes an earlier launcher started (the provisioner adopts them) are
    replaced when lost; a node that joined by itself is not."""
    settings = JobSettings(1, 2, 1, 2, wait_timeout=20.0, start_grace=5.0)
    store.put(keys.JOB_CONFIG, JobConfig(settings, ("python", "train.py")).to_json())
    joined, managed = SimulatedNode(store, "a0"), SimulatedNode(store, "a1")
    leader = store.grant_lease(30)
    assert store.create(keys.LEADER, {"rendezvous": None}, lease=leader) is not None
    provisioner = RecordingProvisioner(manages=frozenset({"a1"}))
    lost = LogLines("node a0 was lost (dead or cut off)")
    caplog.set_level(logging.INFO, logger="elastic-run")
    logging.getLogger("elastic-run").addHandler(lost)
    try:
        with start_launcher(store, provisioner, max_restarts=2, standby=True) as (result, _):
            leader.revoke()  # the leader is gone: the standby takes the job over
            wait_for(
                store,
                lambda j: j.leader is not None and j.leader.record.rendezvous is not None,
                20,
                "the standby leading",
            )
            assert joined.proc_lease is not None
            joined.proc_lease.revoke()
            joined.member_lease.revoke()
            assert lost.seen.wait(20), "the launcher never noticed a0's loss"
            assert provisioner.started == []  # a0 joined by itself: nothing here starts it
            assert managed.proc_lease is not None
            managed.proc_lease.revoke()
            managed.member_lease.revoke()
            assert provisioner.changed.wait(20), "no replacement for the managed node a1"
            assert provisioner.started == ["n0"]
            assert not result.done()
    finally:
        logging.getLogger("elastic-run").removeHandler(lost)


def test_a_takeover_waiting_for_the_ring_s_nodes_counts_them_as_members_meanwhile(
    store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #12: a node whose lease lapsed in an etcd outage asks the launcher that took over
    whether it still counts before it registers again; told no, its agent would stop its
    processes (seen in test_takeover_outage under load: a failure epoch after the adoption)."""
    settings = JobSettings(1, 2, 1, 1, wait_timeout=20.0, start_grace=5.0)
    store.put(keys.JOB_CONFIG, JobConfig(settings, ("python", "train.py")).to_json())
    SimulatedNode(store, "a0")  # a1's records are gone: its leases expired in the outage
    store.put(keys.RING, Ring(1, ("a0.0", "a1.0"), RingState.RUNNING, "127.0.0.1:1").to_json())
    leader = store.grant_lease(30)
    assert store.create(keys.LEADER, {"rendezvous": None}, lease=leader) is not None
    waiting = LogLines("waiting up to")
    caplog.set_level(logging.INFO, logger="elastic-run")
    logging.getLogger("elastic-run").addHandler(waiting)
    try:
        with start_launcher(store, RecordingProvisioner(), standby=True) as (result, _):
            leader.revoke()  # the leader is gone: the standby takes the job over
            job = wait_for(
                store,
                lambda j: j.leader is not None and j.leader.record.rendezvous is not None,
                20,
                "the standby leading",
            )
            assert job.leader is not None
            endpoint = job.leader.record.endpoint()
            assert endpoint is not None
            assert waiting.seen.wait(20), "the standby did not wait for a1"
            asked = ask_standing(endpoint, "a1", timeout=10.0)
            assert asked is not None and asked.member, asked
            stranger = ask_standing(endpoint, "a7", timeout=10.0)
            assert stranger is not None and not stranger.member
            # Once the launcher's loop has looked at the members (a7 registers and counts),
            # a1 still counts: the policy waits for it.
            SimulatedNode(store, "a7")
            deadline = time.monotonic() + 20.0
            while not (seen := ask_standing(endpoint, "a7", timeout=10.0)) or not seen.member:
                assert time.monotonic() < deadline, "a7 never counted as a member"
                threading.Event().wait(0.05)
            asked = ask_standing(endpoint, "a1", timeout=10.0)
            assert asked is not None and asked.member, asked
            assert not result.done()
    finally:
        logging.getLogger("elastic-run").removeHandler(waiting)
