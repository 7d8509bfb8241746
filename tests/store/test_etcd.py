"""etcd-specific behaviour: server crashes and restarts, compaction, endpoints, errors."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_allreduce.errors import ConfigError, StoreUnavailableError
from elastic_allreduce.store import EmbeddedEtcd, Endpoint, EtcdStore, EventType, parse_endpoints
from elastic_allreduce.store.embedded import free_port
from tests.conftest import StoreFactory, fresh_job_id
from tests.store.test_contract import next_event


def test_watch_gets_every_event_across_a_kill_9_and_restart(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    job = fresh_job_id()
    watcher, writer = private_store_factory(job), private_store_factory(job)
    watch = watcher.watch_prefix("members/")
    lease = watcher.grant_lease(2)
    before = [writer.put("members/a", 1), writer.put("members/b", 2)]
    watcher.put("members/mine", "leased", lease=lease)
    private_etcd.kill()
    with pytest.raises(StoreUnavailableError, match=r"is unreachable: .*pass --etcd"):
        writer.put("members/c", 3)
    private_etcd.restart()
    # Written right after the restart, before the watch has necessarily reconnected.
    after = [writer.put("members/c", 3), writer.put("members/d", 4)]
    assert writer.delete("members/a")
    events = [next_event(watch, timeout=20) for _ in range(6)]
    assert [(e.type, e.key) for e in events] == [
        (EventType.PUT, "members/a"),
        (EventType.PUT, "members/b"),
        (EventType.PUT, "members/mine"),
        (EventType.PUT, "members/c"),
        (EventType.PUT, "members/d"),
        (EventType.DELETE, "members/a"),
    ]
    assert [e.revision for e in events[:2]] == before
    assert [e.revision for e in events[3:5]] == after
    assert watch.get(1.0) is None  # nothing twice
    # The lease survived the outage: keep-alive resumed and the key is still there.
    assert not lease.lost
    kv = writer.get("members/mine")
    assert kv is not None and kv.lease == lease.id


def test_watch_gives_up_loudly_when_etcd_stays_down(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    store = private_store_factory()
    watch = store.watch_prefix(give_up_after=1.0)
    private_etcd.kill()
    deadline = time.monotonic() + 30
    with pytest.raises(StoreUnavailableError, match="could not reconnect"):
        while time.monotonic() < deadline:
            assert watch.get(0.5) is None
    with pytest.raises(StoreUnavailableError):  # and keeps saying so
        watch.get(0.1)


def test_watch_resyncs_with_a_full_listing_after_compaction(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    store = private_store_factory()
    assert isinstance(store, EtcdStore)
    first = store.put("members/a", 1)
    store.put("members/b", 2)
    store.delete("members/a")
    latest = store.put("members/c", 3)
    store.transport.call("kv/compaction", {"revision": str(latest), "physical": True})
    watch = store.watch_prefix("members/", start_revision=first)
    resync = next_event(watch)
    assert resync.type is EventType.RESYNC
    assert resync.snapshot is not None
    assert [(kv.key, kv.value) for kv in resync.snapshot] == [("members/b", 2), ("members/c", 3)]
    assert resync.revision >= latest
    # And it keeps watching live changes afterwards.
    revision = store.put("members/d", 4)
    live = next_event(watch)
    assert (live.type, live.key, live.revision) == (EventType.PUT, "members/d", revision)


def test_unreachable_endpoint_gives_the_documented_error() -> None:
    port = free_port()
    store = EtcdStore(f"127.0.0.1:{port}", "job-x", request_timeout=2.0)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        store.get("members/a")
    message = str(info.value)
    assert message.startswith(f"etcd at 127.0.0.1:{port} is unreachable: ")
    assert message.endswith("start it or pass --etcd HOST:PORT")
    assert time.monotonic() - started < 10
    with pytest.raises(StoreUnavailableError):
        store.check()
    with pytest.raises(StoreUnavailableError):
        store.grant_lease(1)
    with pytest.raises(StoreUnavailableError):
        store.watch_prefix()


def test_a_dead_endpoint_before_a_live_one_is_skipped(etcd_server: EmbeddedEtcd) -> None:
    dead = f"127.0.0.1:{free_port()}"
    store = EtcdStore(f"{dead},{etcd_server.endpoints_text}", fresh_job_id())
    try:
        revision = store.put("members/a", 1)
        kv = store.get("members/a")
        assert kv is not None and kv.mod_revision == revision
        watch = store.watch_prefix("members/")
        store.put("members/b", 2)
        event = next_event(watch)
        assert event.key == "members/b"
    finally:
        store.close()


def test_lease_keepalive_survives_a_restart_shorter_than_its_ttl(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    holder = private_store_factory()
    lease = holder.grant_lease(3)
    holder.put("members/me", 1, lease=lease)
    private_etcd.stop()
    private_etcd.restart()
    observer = private_store_factory(holder.job_id)
    watch = observer.watch_prefix("members/")
    assert watch.get(4.0) is None  # longer than the TTL: keep-alive resumed after the restart
    assert observer.get("members/me") is not None
    assert not lease.lost


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", (Endpoint("127.0.0.1", 2379),)),
        ("http://a:1,b:2", (Endpoint("a", 1), Endpoint("b", 2))),
        ("etcd-0", (Endpoint("etcd-0", 2379),)),
        ("[::1]:2379", (Endpoint("::1", 2379),)),
    ],
)
def test_parse_endpoints(text: str, expected: tuple[Endpoint, ...]) -> None:
    assert parse_endpoints(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "host:abc", ":2379", "h:70000", "a:1,,b:2"])
def test_parse_endpoints_rejects_bad_input(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid etcd endpoint"):
        parse_endpoints(text)


def test_https_endpoints_are_tls_and_print_as_given() -> None:
    endpoints = parse_endpoints("https://etcd-0:2379,https://[::1]:2380")
    assert [(e.host, e.port, e.tls) for e in endpoints] == [
        ("etcd-0", 2379, True),
        ("::1", 2380, True),
    ]
    assert [str(e) for e in endpoints] == ["https://etcd-0:2379", "https://[::1]:2380"]
    assert [str(e) for e in parse_endpoints("http://a:1,b:2")] == ["a:1", "b:2"]


@pytest.mark.parametrize("job_id", ["", "Job", "job_1", "-job", "job-", "x" * 41, "a/b"])
def test_invalid_job_ids_are_rejected(job_id: str) -> None:
    with pytest.raises(ConfigError, match="invalid job id"):
        EtcdStore("127.0.0.1:2379", job_id)


def test_parallel_clients_and_threads_share_one_store_safely(store_factory: StoreFactory) -> None:
    store = store_factory()
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            for n in range(10):
                store.put(f"members/{index}-{n}", n)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(store.get_prefix("members/")) == 40
