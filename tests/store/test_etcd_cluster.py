"""The store on a 3-member etcd cluster: a dead or stalled member costs nothing, a killed
member rejoins; and the cluster helper removes everything it made."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_allreduce.store import EtcdStore
from tests.conftest import fresh_job_id
from tests.helpers.etcd_cluster import EtcdCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

#: Seconds a request may take at one member: shorter than the default, so that a keep-alive
#: held for it (the defect) loses the lease within the test's few seconds.
REQUEST_TIMEOUT = 3.0
#: The shortest TTL etcd grants with its default 1 s election timeout.
TTL = 2


def endpoints_from(cluster: EtcdCluster, first: int) -> str:
    """Every member's endpoint, member ``first`` first (where a new client goes first)."""
    order = [first] + [i for i in range(cluster.size) if i != first]
    return ",".join(cluster.members[i].endpoints_text for i in order)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    with EtcdCluster(base_dir=tmp_path / "cluster") as started:
        yield started


def test_a_lease_outlives_a_stalled_member_that_its_client_asks_first(
    cluster: EtcdCluster,
) -> None:
    """A stopped member accepts connections and answers nothing: a keep-alive that waited the
    whole request timeout there (longer than the TTL) lost the lease of a healthy cluster."""
    stalled = (cluster.leader() + 1) % cluster.size  # a follower: quorum and leader remain
    store = EtcdStore(
        endpoints_from(cluster, stalled), fresh_job_id(), request_timeout=REQUEST_TIMEOUT
    )
    try:
        lease = store.grant_lease(TTL)
        store.put("members/me", 1, lease=lease)
        cluster.stop(stalled)
        # Longer than a keep-alive held at the stalled member for the request timeout.
        assert not lease.wait_lost(REQUEST_TIMEOUT + 2 * TTL), "the lease was lost"
        assert store.get("members/me") is not None
    finally:
        cluster.cont(stalled)
        store.close()


def test_calls_fail_over_when_the_leader_dies_and_the_member_rejoins(
    cluster: EtcdCluster,
) -> None:
    leader = cluster.leader()
    store = EtcdStore(
        endpoints_from(cluster, leader),
        fresh_job_id(),
        outage_timeout=30.0,
        request_timeout=REQUEST_TIMEOUT,
    )
    try:
        lease = store.grant_lease(TTL)
        store.put("members/me", 1, lease=lease)
        cluster.kill(leader)
        killed_at = time.monotonic()
        store.put("ring", {"epoch": 2})
        blocked = time.monotonic() - killed_at
        # At worst a follower holds the write for one request timeout (etcd drops a proposal
        # forwarded to a dead leader), then another member takes it.
        assert blocked < REQUEST_TIMEOUT + 2.0, f"a put waited {blocked:.1f} s"
        assert cluster.leader() != leader
        assert not lease.wait_lost(2 * TTL), "the new leader let the lease expire"

        cluster.restart(leader)  # healthy again: it follows the new leader
        alone = EtcdStore(cluster.members[leader].endpoints_text, store.job_id)
        try:
            kv = alone.get("ring")
            assert kv is not None and kv.value == {"epoch": 2}
        finally:
            alone.close()
    finally:
        store.close()


def test_calls_wait_out_a_quorum_loss(cluster: EtcdCluster) -> None:
    leader = cluster.leader()
    store = EtcdStore(
        endpoints_from(cluster, leader),
        fresh_job_id(),
        outage_timeout=30.0,
        request_timeout=REQUEST_TIMEOUT,
    )
    try:
        store.put("ring", {"epoch": 1})
        stopped = [leader, (leader + 1) % cluster.size]
        for index in stopped:
            cluster.stop(index)
        done = threading.Event()
        revisions: list[int] = []

        def write() -> None:
            revisions.append(store.put("ring", {"epoch": 2}))
            done.set()

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        assert not done.wait(2.0), "a write succeeded without quorum"
        for index in stopped:
            cluster.cont(index)
        assert done.wait(20.0), "the write did not go through after quorum returned"
        kv = store.get("ring")
        # A plain put retried through the outage is applied at least once: an earlier attempt
        # that a member forwarded before quorum went may be applied after the one answered.
        assert kv is not None and kv.value == {"epoch": 2} and kv.mod_revision >= revisions[0]
        writer.join(timeout=1.0)
    finally:
        store.close()


def test_the_cluster_removes_its_processes_and_folders(tmp_path: Path) -> None:
    cluster = EtcdCluster(base_dir=tmp_path / "c").start()
    pids = [m.pid for m in cluster.members]
    assert len(set(pids)) == 3 and None not in pids
    assert len(set(cluster.endpoints_text.split(","))) == 3
    cluster.stop(0)  # even a stopped member goes
    cluster.close()
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    own = EtcdCluster()
    base = own.base_dir
    with pytest.raises(RuntimeError), own:
        raise RuntimeError("a test failed")
    assert not base.exists()
