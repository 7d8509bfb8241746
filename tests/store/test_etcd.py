"""etcd-specific behaviour: server crashes and restarts, compaction, endpoints, errors."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from etcd3gw import exceptions as etcd3gw_exceptions

from elastic_allreduce.errors import ConfigError, StoreUnavailableError
from elastic_allreduce.store import EmbeddedEtcd, Endpoint, EtcdStore, EventType, parse_endpoints
from elastic_allreduce.store.api import Watch
from elastic_allreduce.store.embedded import free_port
from elastic_allreduce.store.etcd import _EtcdWatch
from elastic_allreduce.store.latest import LatestValueWriter
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


def test_a_watch_gives_up_only_after_one_outage_as_long_as_its_limit(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    # Found by `make soak`: the outage was counted from the watch's first lost stream, so agents
    # whose watch had reconnected once died ("could not reconnect for 180 s") at the next etcd
    # member restart, however much later and however short.
    job = fresh_job_id()
    store, writer = private_store_factory(job), private_store_factory(job)
    watch = store.watch_prefix("members/", give_up_after=3.0)
    for round_ in range(2):
        private_etcd.kill()
        lost_at = time.monotonic()
        while time.monotonic() - lost_at < 2.0:  # an outage shorter than the limit
            assert watch.get(0.2) is None
        private_etcd.restart()
        revision = writer.put(f"members/{round_}", round_)
        assert next_event(watch, timeout=20).revision == revision
    # Both outages together lasted longer than the limit: the watch still lives.
    revision = writer.put("members/last", "x")
    assert next_event(watch, timeout=20).revision == revision


def test_a_watch_counts_an_outage_from_its_start_after_a_stream_went_idle(
    private_etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by `make soak` too: a stream that had answered and then went idle (a stopped member
    # sends nothing) was reopened without the count starting again, so the next attempt that
    # got no answer gave up at once, counting from an outage long over.
    monkeypatch.setattr(_EtcdWatch, "IDLE_REOPEN_S", 0.5)
    job = fresh_job_id()
    store = EtcdStore(private_etcd.endpoints_text, job, request_timeout=1.0)
    writer = EtcdStore(private_etcd.endpoints_text, job)
    try:
        watch = store.watch_prefix("members/", give_up_after=4.0)
        private_etcd.kill()  # an earlier outage, shorter than the limit
        _quiet(watch, 2.0)
        private_etcd.restart()
        revision = writer.put("members/a", 1)
        assert next_event(watch, timeout=20).revision == revision
        _quiet(watch, 2.5)  # the limit has passed since that outage began
        pid = private_etcd.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the stream goes idle; the next one gets no answer
        try:
            _quiet(watch, 2.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        revision = writer.put("members/b", 2)
        assert next_event(watch, timeout=20).revision == revision
    finally:
        store.close()
        writer.close()


def _quiet(watch: Watch, seconds: float) -> None:
    """No event and no error for ``seconds``."""
    since = time.monotonic()
    while time.monotonic() - since < seconds:
        assert watch.get(0.2) is None


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
    with pytest.raises(StoreUnavailableError) as info:
        store.get("members/a")
    message = str(info.value)
    assert message.startswith(f"etcd at 127.0.0.1:{port} is unreachable: ")
    assert message.endswith("start it or pass --etcd HOST:PORT")
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


def test_calls_wait_out_an_outage_up_to_the_outage_timeout(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    job = fresh_job_id()
    patient = EtcdStore(private_etcd.endpoints_text, job, outage_timeout=30.0)
    hasty = private_store_factory(job)
    try:
        private_etcd.stop()
        with pytest.raises(StoreUnavailableError, match="is unreachable"):
            hasty.put("k", 1)
        # The put runs in a thread (etcd dies with the thread that starts it: PDEATHSIG).
        revisions: list[int] = []
        putter = threading.Thread(target=lambda: revisions.append(patient.put("k", 2)))
        putter.start()
        putter.join(timeout=1.5)
        assert putter.is_alive() and not revisions  # still retrying while etcd is down
        private_etcd.restart()
        putter.join(timeout=30)
        assert revisions, "the put did not get through after etcd came back"
        kv = hasty.get("k")
        assert kv is not None and kv.value == 2 and kv.mod_revision == revisions[0]
        private_etcd.stop()
        brief = EtcdStore(private_etcd.endpoints_text, job, outage_timeout=1.0)
        with pytest.raises(
            StoreUnavailableError, match=r"unreachable for 1 s \(--outage-timeout\)"
        ):
            brief.get("k")
        brief.close()
    finally:
        patient.close()


def test_a_call_gives_up_at_its_callers_deadline_and_only_that_threads_calls_do(
    private_etcd: EmbeddedEtcd,
) -> None:
    """An etcd that accepts connections but answers nothing (SIGSTOP, as behind a cut link):
    a put inside give_up_at(now + 1) raises within about a second, although the store waits
    out outages for 30 s and each request for 5 s; the same put in another thread, outside
    any deadline, still waits; and the store answers again once etcd does."""
    store = EtcdStore(
        private_etcd.endpoints_text, fresh_job_id(), request_timeout=5.0, outage_timeout=30.0
    )
    pid = private_etcd.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        patient: list[object] = []
        other = threading.Thread(target=lambda: patient.append(store.put("other", 1)))
        other.start()
        started = time.monotonic()
        with (
            store.give_up_at(started + 1.0),
            pytest.raises(StoreUnavailableError, match="gave up at the caller's deadline"),
        ):
            store.put("k", 1)
        took = time.monotonic() - started
        assert took < 2.0, took  # one attempt fits the deadline, not the 5 s request timeout
        assert store.caller_deadline() is None  # the deadline ends with its block
        other.join(timeout=1.5)
        assert other.is_alive() and not patient  # no deadline there: still waiting
    finally:
        os.kill(pid, signal.SIGCONT)
    other.join(timeout=30)
    assert patient, "the other thread's put did not get through once etcd answered"
    with store.give_up_at(time.monotonic() + 5.0):
        assert store.put("k", 2) > 0
    store.close()


def test_closing_after_an_outage_leaves_the_leases_to_their_ttl(
    private_etcd: EmbeddedEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose etcd stayed away past its deadline (a job that fails of the outage) does
    not wait on it once more per lease when it closes: the leases expire by their TTL."""
    job = fresh_job_id()
    store = EtcdStore(private_etcd.endpoints_text, job, outage_timeout=1.0)
    leases = [store.grant_lease(60) for _ in range(2)]
    private_etcd.stop()
    with pytest.raises(StoreUnavailableError, match=r"unreachable for 1 s \(--outage-timeout\)"):
        store.get("k")
    with caplog.at_level(logging.WARNING):
        store.close()
    assert not [r for r in caplog.records if "could not revoke" in r.getMessage()]
    private_etcd.restart()
    checker = EtcdStore(private_etcd.endpoints_text, job)
    try:
        for lease in leases:
            remaining = checker.lease_remaining(lease.id)
            assert remaining is not None and remaining > 0  # left to expire, not revoked
    finally:
        checker.close()


def test_a_retried_compare_and_swap_whose_reply_was_lost_is_ours(
    store_factory: StoreFactory,
) -> None:
    store = store_factory()
    assert isinstance(store, EtcdStore)
    store.outage_timeout = 5.0
    first = store.put("ring", {"epoch": 1})
    transport = store.transport
    real_call = transport.call_reporting
    lost: list[dict[str, Any]] = []

    def reply_lost_once(
        path: str, payload: Mapping[str, Any], **options: Any
    ) -> tuple[dict[str, Any], bool]:
        reply = real_call(path, payload, **options)
        if path == "kv/txn" and not lost:
            lost.append(reply[0])
            raise transport.unavailable("the reply was lost")
        return reply

    transport.call_reporting = reply_lost_once  # type: ignore[method-assign]
    revision = store.compare_and_swap("ring", {"epoch": 2}, expected_mod_revision=first)
    assert lost and lost[0]["succeeded"]  # the first attempt was applied
    kv = store.get("ring")
    assert kv is not None and revision == kv.mod_revision and kv.value == {"epoch": 2}
    # Someone else's value is still a failed comparison.
    store.put("ring", {"epoch": 3})
    lost.clear()
    assert store.compare_and_swap("ring", {"epoch": 4}, expected_mod_revision=first) is None


def store_whose_first_member_loses_txn_replies(
    etcd_server: EmbeddedEtcd, job_id: str, lost: list[str]
) -> EtcdStore:
    """A store of two endpoints of one server (a cluster whose members agree at once), whose
    first member applies every transaction and then times out (its reply never arrives)."""
    endpoints = f"{etcd_server.endpoints_text},{etcd_server.endpoints_text}"
    store = EtcdStore(endpoints, job_id)
    real_post = store.transport._post

    def reply_lost(client: Any, index: int, path: str, *args: Any) -> object:
        reply = real_post(client, index, path, *args)
        if path == "kv/txn" and index == 0:
            lost.append(path)
            raise etcd3gw_exceptions.ConnectionTimeoutError("read timed out (a test)")
        return reply

    store.transport._post = reply_lost  # type: ignore[method-assign]
    return store


def test_a_write_applied_by_a_member_that_then_timed_out_is_ours_at_the_next_member(
    etcd_server: EmbeddedEtcd,
) -> None:
    """Failover within one call: the first member applies a transaction, its reply is lost
    (it timed out, or went away), the next member then finds the comparison failed. That
    failure is our own write, not someone else's."""
    job_id = fresh_job_id()
    lost: list[str] = []
    store = store_whose_first_member_loses_txn_replies(etcd_server, job_id, lost)
    try:
        first = store.put("ring", {"epoch": 1})
        revision = store.compare_and_swap("ring", {"epoch": 2}, expected_mod_revision=first)
        kv = store.get("ring")
        assert lost and kv is not None and kv.value == {"epoch": 2}
        assert revision == kv.mod_revision, "our own applied write was taken for a conflict"
    finally:
        store.close()
    lost.clear()
    store = store_whose_first_member_loses_txn_replies(etcd_server, job_id, lost)
    try:
        assert store.delete("ring", expected_mod_revision=kv.mod_revision)
        assert lost and store.get("ring") is None
    finally:
        store.close()


def test_the_latest_value_writer_never_waits_for_etcd_and_writes_the_last_value(
    private_etcd: EmbeddedEtcd, private_store_factory: StoreFactory
) -> None:
    job = fresh_job_id()
    reader = private_store_factory(job)
    writer = LatestValueWriter(
        lambda: EtcdStore(private_etcd.endpoints_text, job, outage_timeout=60.0), "status/progress"
    )
    try:
        writer.submit({"step": 1})
        assert writer.flush(20)
        private_etcd.stop()
        for step in range(2, 50):  # returns at once although etcd is down
            writer.submit({"step": step})
        assert not writer.flush(0.5)
        private_etcd.restart()
        assert writer.flush(30)
        kv = reader.get("status/progress")
        assert kv is not None and kv.value == {"step": 49}
        # Superseded values were skipped, not written one by one.
        assert kv.version < 10
    finally:
        writer.close()
