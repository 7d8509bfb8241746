"""A training process's record under its node's lease (elastic_allreduce.bootstrap.registration),
on a real etcd: it follows the node to a new lease after etcd let the old one expire."""

from __future__ import annotations

import os
import threading

import pytest

from elastic_allreduce.bootstrap import registration
from elastic_allreduce.bootstrap.registration import Registration
from elastic_allreduce.errors import LeaseLostError
from elastic_allreduce.records import keys
from elastic_allreduce.records.values import MemberRecord, ProcPhase, ProcRecord
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from tests.conftest import fresh_job_id

MEMBER = MemberRecord("host-0", 1, 1).to_json()


def stores(etcd_server: EmbeddedEtcd) -> tuple[EtcdStore, EtcdStore]:
    job = fresh_job_id()
    return EtcdStore(etcd_server.endpoints_text, job), EtcdStore(etcd_server.endpoints_text, job)


def stored(store: EtcdStore, slot: str) -> tuple[ProcRecord, int | None]:
    kv = store.get(keys.proc(slot))
    assert kv is not None, f"no record of {slot}"
    return ProcRecord.from_json(kv.key, kv.value), kv.lease


def test_the_record_lives_under_the_node_lease_and_follows_it_to_a_new_one(
    etcd_server: EmbeddedEtcd,
) -> None:
    agent, process = stores(etcd_server)
    try:
        old = agent.grant_lease(2)
        agent.put(keys.member("n0"), MEMBER, lease=old)
        first = ProcRecord(os.getpid(), 1, ProcPhase.STARTING)
        held = Registration(process, "n0.0", first, old.id)
        record, lease = stored(process, "n0.0")
        assert record.lease == lease == old.id and record.phase is ProcPhase.STARTING
        old.revoke()  # as etcd does with a lease that expired during an outage
        assert process.get(keys.proc("n0.0")) is None
        new = agent.grant_lease(2)
        # The process writes while its agent registers the node again under the new lease.
        writer = threading.Thread(
            target=held.update, args=(ProcRecord(os.getpid(), 1, ProcPhase.TRAINING, epoch=3),)
        )
        writer.start()
        assert agent.create(keys.member("n0"), MEMBER, lease=new) is not None
        writer.join(timeout=30)
        assert not writer.is_alive()
        record, lease = stored(process, "n0.0")
        assert record.lease == lease == new.id == held.lease.id
        assert (record.phase, record.epoch) == (ProcPhase.TRAINING, 3)
        new.revoke()  # the node's lease goes: its process's record with it
        assert process.get(keys.proc("n0.0")) is None
    finally:
        agent.close()
        process.close()


def test_a_node_that_does_not_register_again_fails_the_write_with_one_error(
    etcd_server: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registration, "NODE_REGISTER_WAIT", 1.0)
    agent, process = stores(etcd_server)
    try:
        lease = agent.grant_lease(2)
        agent.put(keys.member("n0"), MEMBER, lease=lease)
        held = Registration(
            process, "n0.0", ProcRecord(os.getpid(), 1, ProcPhase.STARTING), lease.id
        )
        lease.revoke()
        with pytest.raises(LeaseLostError, match="did not register the node again within 1 s"):
            held.update(ProcRecord(os.getpid(), 1, ProcPhase.TRAINING))
        assert process.get(keys.proc("n0.0")) is None  # nothing written without a lease
    finally:
        agent.close()
        process.close()
