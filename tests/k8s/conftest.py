"""Shared pieces of the Kubernetes tests: a job's store view, worker templates, the fake."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import parse_job
from elastic_allreduce.records.values import JobConfig, JobSettings, MemberRecord
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, KeyValue
from elastic_allreduce.store.api import WatchEvent
from elastic_allreduce.store.cache import PrefixCache, drain
from tests.conftest import fresh_job_id
from tests.helpers.fake_kube import FakeKube


class StoreView:
    """A job's keys kept current from the store's watch, to wait on conditions with deadlines."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self._inbox: queue.Queue[object] = queue.Queue()
        self._cache = PrefixCache(store, self._inbox)
        #: Every change seen, in order: (key, value or None for a deletion).
        self.history: list[tuple[str, Any]] = []

    def keys(self) -> Mapping[str, KeyValue]:
        return self._cache.items()

    def members(self) -> dict[str, MemberRecord]:
        """The live members, typed (junk skipped)."""
        job = parse_job(self.keys().values(), self._cache.revision)
        return {node: stored.record for node, stored in job.members.items()}

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {what}; keys: {list(self.keys())}")
            for item in drain(self._inbox, timeout=min(remaining, 0.5)):
                if isinstance(item, WatchEvent):
                    self.history.append((item.key, item.kv.value if item.kv else None))
                self._cache.apply(item)

    def close(self) -> None:
        self._cache.close()


def write_job_config(store: EtcdStore, command: list[str]) -> None:
    """What a launcher writes at config/job, enough for agents (`elastic-run join`) to start."""
    config = JobConfig(JobSettings(1, 4, 1, 0), tuple(command))
    store.put(keys.JOB_CONFIG, config.to_json())


def join_template(**container: Any) -> dict[str, Any]:
    """A worker Pod manifest whose container is just `elastic-run join` (env comes from the
    provisioner), as in k8s/."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "terminationGracePeriodSeconds": 20,
            "containers": [
                {
                    "name": "worker",
                    "image": "elastic-allreduce:dev",
                    "command": ["elastic-run", "join"],
                    **container,
                }
            ],
        },
    }


@pytest.fixture
def job_id() -> str:
    return fresh_job_id("k8s")


@pytest.fixture
def job_store(etcd_server: EmbeddedEtcd, job_id: str) -> Iterator[EtcdStore]:
    store = EtcdStore(etcd_server.endpoints_text, job_id)
    yield store
    store.close()


@pytest.fixture
def store_view(job_store: EtcdStore) -> Iterator[StoreView]:
    view = StoreView(job_store)
    yield view
    view.close()


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    with FakeKube() as kube:
        yield kube
