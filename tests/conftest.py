"""Fixtures: real etcd servers on free loopback ports, and stores scoped to fresh job ids."""

from __future__ import annotations

import base64
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, Store

ROOT = Path(__file__).resolve().parent.parent
_job_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """One etcd for the tests that do not stop it (each test uses its own job ids)."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own, which the test may kill and restart."""
    server = EmbeddedEtcd(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.close()


def fresh_job_id(stem: str = "job") -> str:
    return f"{stem}-{os.getpid()}-{next(_job_numbers)}"


StoreFactory = Callable[..., Store]


def _etcd_store_factory(server: EmbeddedEtcd, made: list[Store]) -> StoreFactory:
    def make(job_id: str | None = None, endpoints: str | None = None) -> Store:
        store = EtcdStore(endpoints or server.endpoints_text, job_id or fresh_job_id())
        made.append(store)
        return store

    return make


@pytest.fixture(params=["etcd"])
def store_factory(
    request: pytest.FixtureRequest, etcd_server: EmbeddedEtcd
) -> Iterator[StoreFactory]:
    """Makes stores of one implementation (the contract suite runs once per implementation)."""
    made: list[Store] = []
    if request.param == "etcd":
        yield _etcd_store_factory(etcd_server, made)
    for store in made:
        store.close()


@pytest.fixture
def private_store_factory(private_etcd: EmbeddedEtcd) -> Iterator[StoreFactory]:
    """Makes etcd stores on this test's own server (for restart and compaction tests)."""
    made: list[Store] = []
    yield _etcd_store_factory(private_etcd, made)
    for store in made:
        store.close()


def write_raw(store: Store, key: str, raw: bytes) -> None:
    """Write bytes that bypass the JSON envelope (what a foreign or buggy writer leaves)."""
    assert isinstance(store, EtcdStore), f"no raw writer for {type(store).__name__}"
    store.transport.call(
        "kv/put",
        {
            "key": base64.b64encode(store.absolute(key).encode()).decode(),
            "value": base64.b64encode(raw).decode(),
        },
    )


def start_python(module: str, *args: str) -> subprocess.Popen[str]:
    """Start ``python -m module args`` from the project root with pipes for stdin and stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
