"""The membership store contract, run against every implementation on a real server."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

from elastic_allreduce.errors import (
    ConfigError,
    LeaseLostError,
    MalformedValueError,
    StoreError,
    WatchClosedError,
)
from elastic_allreduce.store import EventType, Lease, LeaseRef, Store, Watch, WatchEvent
from tests.conftest import StoreFactory, fresh_job_id, start_python, write_raw


def next_event(watch: Watch, timeout: float = 10.0) -> WatchEvent:
    event = watch.get(timeout)
    assert event is not None, f"no watch event within {timeout} s"
    return event


def test_put_get_roundtrip_with_revisions(store_factory: StoreFactory) -> None:
    store = store_factory()
    assert store.get("members/a") is None
    first = store.put("members/a", {"host": "h1", "slots": 2})
    second = store.put("members/a", {"host": "h1", "slots": 4})
    assert second > first
    kv = store.get("members/a")
    assert kv is not None
    assert kv.value == {"host": "h1", "slots": 4}
    assert (kv.mod_revision, kv.create_revision, kv.version) == (second, first, 2)
    assert kv.lease is None
    # A snapshot is immutable: changing the decoded copy does not change the snapshot.
    value = kv.value
    assert isinstance(value, dict)
    value["slots"] = 99
    assert kv.value == {"host": "h1", "slots": 4}


def test_get_prefix_is_sorted_scoped_and_carries_its_revision(store_factory: StoreFactory) -> None:
    store = store_factory()
    store.put("members/b", 2)
    store.put("members/a", 1)
    last = store.put("ring", {"epoch": 1})
    snapshot = store.get_prefix("members/")
    assert [kv.key for kv in snapshot] == ["members/a", "members/b"]
    assert [kv.value for kv in snapshot] == [1, 2]
    assert snapshot.revision >= last
    assert [kv.key for kv in store.get_prefix()] == ["members/a", "members/b", "ring"]


def test_create_if_absent_is_exclusive_between_clients(store_factory: StoreFactory) -> None:
    job = fresh_job_id()
    contenders = [store_factory(job) for _ in range(8)]
    barrier = threading.Barrier(len(contenders))
    results: dict[int, int | None] = {}

    def contend(index: int, store: Store) -> None:
        barrier.wait(timeout=10)
        results[index] = store.create("launcher/leader", {"who": index})

    threads = [threading.Thread(target=contend, args=pair) for pair in enumerate(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    winners = [index for index, revision in results.items() if revision is not None]
    assert len(results) == len(contenders)
    assert len(winners) == 1
    kv = contenders[0].get("launcher/leader")
    assert kv is not None and kv.value == {"who": winners[0]}
    assert kv.mod_revision == results[winners[0]]


def test_compare_and_swap_detects_a_concurrent_writer(store_factory: StoreFactory) -> None:
    job = fresh_job_id()
    mine, theirs = store_factory(job), store_factory(job)
    mine.put("ring", {"epoch": 1})
    seen = mine.get("ring")
    assert seen is not None
    theirs.put("ring", {"epoch": 2, "by": "them"})
    assert (
        mine.compare_and_swap(
            "ring", {"epoch": 2, "by": "me"}, expected_mod_revision=seen.mod_revision
        )
        is None
    )
    current = mine.get("ring")
    assert current is not None and current.value == {"epoch": 2, "by": "them"}
    revision = mine.compare_and_swap(
        "ring", {"epoch": 3}, expected_mod_revision=current.mod_revision
    )
    assert revision is not None
    after = theirs.get("ring")
    assert after is not None and after.value == {"epoch": 3} and after.mod_revision == revision


def test_compare_and_swap_loses_no_update_under_contention(store_factory: StoreFactory) -> None:
    job = fresh_job_id()
    clients = [store_factory(job) for _ in range(4)]
    clients[0].put("counter", 0)
    increments, conflicts = 20, [0]

    def increment(store: Store) -> None:
        for _ in range(increments):
            while True:
                kv = store.get("counter")
                assert kv is not None
                value = kv.value
                assert isinstance(value, int)
                if store.compare_and_swap(
                    "counter", value + 1, expected_mod_revision=kv.mod_revision
                ):
                    break
                conflicts[0] += 1

    threads = [threading.Thread(target=increment, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    final = clients[0].get("counter")
    assert final is not None and final.value == increments * len(clients)
    # The clients did collide (else this test shows nothing about compare-and-swap).
    assert conflicts[0] > 0


def test_delete_and_conditional_delete(store_factory: StoreFactory) -> None:
    store = store_factory()
    revision = store.put("status/phase", "running")
    assert not store.delete("status/phase", expected_mod_revision=revision - 1)
    assert store.get("status/phase") is not None
    assert store.delete("status/phase", expected_mod_revision=revision)
    assert store.get("status/phase") is None
    assert not store.delete("status/phase")
    store.put("status/phase", "done")
    assert store.delete("status/phase")


def test_create_fails_for_an_existing_key_and_cas_zero_means_absent(
    store_factory: StoreFactory,
) -> None:
    store = store_factory()
    assert store.create("members/x", 1) is not None
    assert store.create("members/x", 2) is None
    assert store.compare_and_swap("members/y", 3, expected_mod_revision=0) is not None
    kv = store.get("members/x")
    assert kv is not None and kv.value == 1


def test_lease_expiry_after_sigkill_removes_the_key_and_the_watch_sees_delete(
    store_factory: StoreFactory,
) -> None:
    store = store_factory()
    watch = store.watch_prefix("members/")
    holder = start_python(
        "tests.helpers.lease_holder",
        store.describe().removeprefix("etcd at "),
        store.job_id,
        "members/holder",
        "1",
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.startswith("ready "), line
        put = next_event(watch)
        assert (put.type, put.key) == (EventType.PUT, "members/holder")
        assert put.kv is not None and put.kv.lease is not None
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        deleted = next_event(watch, timeout=15)
        assert (deleted.type, deleted.key) == (EventType.DELETE, "members/holder")
        assert deleted.revision > put.revision
        assert store.get("members/holder") is None
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_keepalive_holds_a_key_past_several_ttls_and_revoke_deletes_it(
    store_factory: StoreFactory,
) -> None:
    store = store_factory()
    lease = store.grant_lease(1)
    assert lease.ttl >= 1
    revision = store.put("members/me", {"alive": True}, lease=lease)
    watch = store.watch_prefix("members/", start_revision=revision + 1)
    # Four TTLs pass with no event: the key stays.
    assert watch.get(4.0) is None
    kv = store.get("members/me")
    assert kv is not None and kv.mod_revision == revision and kv.lease == lease.id
    assert not lease.lost
    lease.revoke()
    deleted = next_event(watch, timeout=5)
    assert (deleted.type, deleted.key) == (EventType.DELETE, "members/me")
    assert lease.lost
    lease.revoke()  # idempotent


def test_a_key_lives_under_a_lease_another_client_keeps_alive(store_factory: StoreFactory) -> None:
    """A training process writes under its node's lease, which its agent keeps alive: the key
    lives as long as that lease, and a write under a lease that is gone fails (nothing is
    written, so a record never outlives its node)."""
    job = fresh_job_id()
    holder, writer = store_factory(job), store_factory(job)
    lease = holder.grant_lease(1)
    revision = writer.put("procs/n0.0", 1, lease=LeaseRef(lease.id))
    watch = writer.watch_prefix("procs/", start_revision=revision + 1)
    assert watch.get(3.0) is None  # three TTLs: the holder's keep-alive holds the key
    kv = writer.get("procs/n0.0")
    assert kv is not None and kv.lease == lease.id
    lease.revoke()
    deleted = next_event(watch, timeout=5)
    assert (deleted.type, deleted.key) == (EventType.DELETE, "procs/n0.0")
    with pytest.raises(LeaseLostError, match="the lease is gone"):
        writer.put("procs/n0.0", 2, lease=LeaseRef(lease.id))
    assert writer.get("procs/n0.0") is None


def let_expire(lease: Lease, holder: Store, watcher: Store) -> None:
    """A key under ``lease``; its keep-alive stopped: returns once ``watcher`` sees the
    server delete the key."""
    holder.put("members/me", 1, lease=lease)
    watch = watcher.watch_prefix("members/")
    lease.stop_keepalive()
    deleted = next_event(watch, timeout=10)
    assert (deleted.type, deleted.key) == (EventType.DELETE, "members/me")


def test_lease_stop_keepalive_lets_the_key_expire(store_factory: StoreFactory) -> None:
    store = store_factory()
    let_expire(store.grant_lease(1), store, store)


def test_lease_revoked_elsewhere_is_reported_lost_once(store_factory: StoreFactory) -> None:
    job = fresh_job_id()
    holder, other = store_factory(job), store_factory(job)
    lost: list[Lease] = []
    lease = holder.grant_lease(1, on_lost=lost.append)
    holder.put("members/me", 1, lease=lease)
    assert not lease.wait_lost(1.5)
    # Another client revokes our lease (as a launcher fencing a hung member would).
    assert other.revoke_lease(lease.id)
    assert not other.revoke_lease(lease.id)
    assert lease.wait_lost(10.0)
    assert lost == [lease]
    assert holder.get("members/me") is None


def test_lease_remaining_is_a_live_leases_ttl_and_none_once_it_expired_or_was_revoked(
    store_factory: StoreFactory,
) -> None:
    job = fresh_job_id()
    holder, other = store_factory(job), store_factory(job)
    live = holder.grant_lease(5)
    remaining = other.lease_remaining(live.id)
    assert remaining is not None and 0 < remaining <= live.ttl, remaining
    revoked = holder.grant_lease(5)
    revoked.revoke()
    assert other.lease_remaining(revoked.id) is None
    expiring = holder.grant_lease(1)
    let_expire(expiring, holder, other)
    assert other.lease_remaining(expiring.id) is None
    assert other.lease_remaining(live.id) is not None


def test_two_job_prefixes_never_see_each_others_keys(store_factory: StoreFactory) -> None:
    stem = fresh_job_id("iso")
    job1, job10 = store_factory(f"{stem}-1"), store_factory(f"{stem}-10")
    watch1 = job1.watch_prefix()
    watch10 = job10.watch_prefix()
    job1.put("members/a", "one")
    job10.put("members/a", "ten")
    job10.put("ring", "ten")
    assert [(kv.key, kv.value) for kv in job1.get_prefix()] == [("members/a", "one")]
    assert [(kv.key, kv.value) for kv in job10.get_prefix()] == [
        ("members/a", "ten"),
        ("ring", "ten"),
    ]
    assert next_event(watch1).kv is not None
    assert watch1.get(1.0) is None
    seen10 = [next_event(watch10), next_event(watch10)]
    assert [(e.key, e.kv.value if e.kv else None) for e in seen10] == [
        ("members/a", "ten"),
        ("ring", "ten"),
    ]
    assert job1.delete("members/a")
    assert job10.get("members/a") is not None


def test_watch_delivers_puts_deletes_and_txn_events_in_order(store_factory: StoreFactory) -> None:
    store = store_factory()
    watch = store.watch_prefix("members/")
    revisions = [store.put(f"members/{i}", i) for i in range(5)]
    store.delete("members/2")
    kv = store.get("members/3")
    assert kv is not None
    store.compare_and_swap("members/3", 33, expected_mod_revision=kv.mod_revision)
    events = [next_event(watch) for _ in range(7)]
    assert [e.type for e in events] == [EventType.PUT] * 5 + [EventType.DELETE, EventType.PUT]
    assert [e.revision for e in events[:5]] == revisions
    assert [e.key for e in events[5:]] == ["members/2", "members/3"]
    assert events[6].kv is not None and events[6].kv.value == 33
    assert watch.revision == events[-1].revision
    watch.close()
    with pytest.raises(WatchClosedError):
        watch.get(0.1)


def test_watch_from_a_snapshot_revision_misses_nothing(store_factory: StoreFactory) -> None:
    store = store_factory()
    store.put("members/a", 1)
    snapshot = store.get_prefix("members/")
    store.put("members/b", 2)  # written between the listing and the watch
    watch = store.watch_prefix("members/", start_revision=snapshot.revision + 1)
    event = next_event(watch)
    assert (event.type, event.key) == (EventType.PUT, "members/b")


def test_malformed_values_are_reported_not_crashed_on(
    store_factory: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_factory()
    watch = store.watch_prefix("members/")
    store.put("members/good", {"ok": True})

    def raw_put(key: str, raw: bytes) -> None:
        write_raw(store, key, raw)

    raw_put("members/garbage", b"\x00not json{")
    raw_put("members/bare", b'{"host": "h"}')
    raw_put("members/future", b'{"schema": 99, "data": {}}')
    with caplog.at_level(logging.WARNING):
        snapshot = store.get_prefix("members/")
    by_key = snapshot.as_dict()
    assert by_key["members/good"].malformed is None
    assert by_key["members/good"].value == {"ok": True}
    assert "not UTF-8 JSON" in (by_key["members/garbage"].malformed or "")
    assert "expected an object" in (by_key["members/bare"].malformed or "")
    assert "schema version 99" in (by_key["members/future"].malformed or "")
    with pytest.raises(MalformedValueError, match="members/future"):
        _ = by_key["members/future"].value
    assert sum("malformed" in r.getMessage() for r in caplog.records) >= 3
    kv = store.get("members/garbage")
    assert kv is not None and kv.malformed is not None
    events = [next_event(watch) for _ in range(4)]
    assert [e.kv.malformed is None for e in events if e.kv] == [True, False, False, False]


def test_bad_keys_and_values_are_rejected_before_anything_is_written(
    store_factory: StoreFactory,
) -> None:
    store = store_factory()
    for key in ["/abs", "a//b", "../x", "a/../b", "sp ace", ""]:
        with pytest.raises(ConfigError, match="invalid store key"):
            store.put(key, 1)
    with pytest.raises(TypeError):
        store.put("k", {"x": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        store.put("k", float("nan"))
    assert len(store.get_prefix()) == 0


def test_watch_close_stops_its_thread(store_factory: StoreFactory) -> None:
    store = store_factory()
    watch = store.watch_prefix()
    watch.close()
    # Stopped by the time close() returns (a hang is the suite's timeout).
    assert not any(
        t.name.startswith(f"watch-{store.job_id}") and t.is_alive() for t in threading.enumerate()
    )


def test_writing_under_a_lost_lease_raises_lease_lost(store_factory: StoreFactory) -> None:
    store = store_factory()
    lease = store.grant_lease(1)
    lease.revoke()
    with pytest.raises(LeaseLostError, match="the lease is gone"):
        store.put("members/me", 1, lease=lease)
    assert store.get("members/me") is None


def test_closing_the_store_revokes_its_leases(store_factory: StoreFactory) -> None:
    job = fresh_job_id()
    owner, observer = store_factory(job), store_factory(job)
    lease = owner.grant_lease(5)
    owner.put("members/me", 1, lease=lease)
    owner.close()
    assert lease.lost
    assert observer.get("members/me") is None
    with pytest.raises(StoreError, match="closed"):
        owner.grant_lease(1)
