"""Shared pieces of the Kubernetes tests: a job's store view, worker templates, the fake."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from elastic_allreduce import logprefix
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import parse_job
from elastic_allreduce.records.values import JobConfig, JobSettings, MemberRecord
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, KeyValue
from elastic_allreduce.store.api import WatchEvent
from elastic_allreduce.store.cache import Inbox, PrefixCache, drain, new_inbox
from tests.conftest import fresh_job_id
from tests.helpers.fake_kube import FakeKube


@dataclass
class PodOutput:
    """Every pod's lines as the fake's pods print them, and the JSON records of the training
    processes' prefixed lines with the prefix they came with (``FakeKube(on_output=...)``)."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    records: list[tuple[logprefix.OutputLine, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, pod: str, line: str) -> None:
        parsed = logprefix.parse_line(line)
        record = None
        if parsed is not None and parsed.text.startswith("{"):
            try:
                record = json.loads(parsed.text)
            except json.JSONDecodeError:
                record = None
        with self.lock:
            self.lines.append((pod, line))
            if parsed is not None and isinstance(record, dict):
                self.records.append((parsed, record))

    def events(self, name: str) -> list[tuple[logprefix.OutputLine, dict[str, Any]]]:
        """The records of one ``event`` (``commit``, ``done``), with their prefixes."""
        with self.lock:
            return [(p, r) for p, r in self.records if r.get("event") == name]

    def commits(self, size: int | None = None) -> list[dict[str, Any]]:
        return [r for _, r in self.events("commit") if size is None or r.get("size") == size]

    def done(self) -> list[dict[str, Any]]:
        return [r for _, r in self.events("done")]

    def of(self, pod: str) -> list[str]:
        with self.lock:
            return [line for p, line in self.lines if p == pod]

    def tail(self, count: int = 80) -> str:
        """The launcher's log (whole), then the last ``count`` lines of every pod."""
        with self.lock:
            launcher = [f"{p}: {line}" for p, line in self.lines if p.endswith("-launcher")]
            last = [f"{p}: {line}" for p, line in self.lines[-count:]]
        return "\n".join([*launcher, "--- last lines of all pods ---", *last])


def wait_showing(
    kube: FakeKube, output: PodOutput, predicate: Callable[[], bool], timeout: float, what: str
) -> None:
    """``kube.wait_for``, failing with every pod's output."""
    try:
        kube.wait_for(predicate, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; output:\n{output.tail()}") from None


def phase(pod: Mapping[str, Any] | None) -> str:
    """A pod's status phase ("None" for no pod or no status yet)."""
    return str((pod or {}).get("status", {}).get("phase"))


class StoreView:
    """A job's keys kept current from the store's watch, to wait on conditions with deadlines."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self._inbox: Inbox = new_inbox()
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


#: The launcher pod's downward-API variables, as the manifests set them.
LAUNCHER_DOWNWARD: dict[str, str] = {
    "ELASTIC_ALLREDUCE_POD_NAME": "metadata.name",
    "ELASTIC_ALLREDUCE_POD_UID": "metadata.uid",
    "ELASTIC_ALLREDUCE_POD_IP": "status.podIP",
    "ELASTIC_ALLREDUCE_NAMESPACE": "metadata.namespace",
}


def launcher_pod(
    name: str,
    command: list[str],
    env: Sequence[Mapping[str, Any]] = (),
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A hand-written launcher pod that runs ``command`` in the fake cluster: ``env`` first,
    then the downward-API variables a launcher reads its pod from."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": dict(metadata or {"name": name, "labels": {"app": "elastic-allreduce"}}),
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "launcher",
                    "image": "elastic-allreduce:dev",
                    "command": command,
                    "env": [
                        *env,
                        *(
                            {"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}}
                            for k, v in LAUNCHER_DOWNWARD.items()
                        ),
                    ],
                }
            ],
        },
    }


@pytest.fixture
def output() -> PodOutput:
    """What the fake kubelet's pods print."""
    return PodOutput()


@pytest.fixture
def kube(output: PodOutput) -> Iterator[FakeKube]:
    """A fake cluster whose kubelet runs pods as processes (their output into ``output``)."""
    with FakeKube(run_pods=True, on_output=output) as fake:
        yield fake
