"""Fixtures: real etcd servers on free loopback ports, and stores scoped to fresh job ids."""

from __future__ import annotations

import base64
import importlib.metadata
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_allreduce.store import EmbeddedEtcd, EtcdSecurity, EtcdStore, Store
from tests.helpers.leftovers import (  # noqa: F401 - hooks: the session-end leftover check
    pytest_addoption,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
    pytest_testnodedown,
)
from tests.helpers.tls import TlsEtcd, start_tls_etcd

ROOT = Path(__file__).resolve().parent.parent


def installed_version(name: str) -> str | None:
    """An installed distribution's version, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


#: Whether tf.keras is Keras 3 here (TensorFlow >= 2.16 without TF_USE_LEGACY_KERAS), without
#: importing TensorFlow.
KERAS3 = int((installed_version("keras") or "0").split(".")[0]) >= 3 and not os.environ.get(
    "TF_USE_LEGACY_KERAS"
)
_job_numbers = itertools.count(1)


def script_result(script: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a test script (one process, real Horovod at size 1) from the repository root; the
    JSON object on its last line of output (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def require_checkout_outside_tmp(what: str) -> None:
    """Fail at once, saying what to do, where ``what`` (a pod with an emptyDir at /tmp, a
    read-only sandbox) gets a fresh /tmp that would hide this checkout and its .venv: its
    ``elastic-run`` could not start, and the test would only time out."""
    if ROOT.is_relative_to("/tmp"):
        pytest.fail(
            f"this checkout ({ROOT}) is under /tmp, which {what} replaces with a /tmp of its "
            "own: run the tests from a checkout outside /tmp (e.g. `git clone . "
            "/var/tmp/elastic-allreduce`)"
        )


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


def _etcd_store_factory(
    server: EmbeddedEtcd, made: list[Store], security: EtcdSecurity | None = None
) -> StoreFactory:
    def make(job_id: str | None = None, endpoints: str | None = None) -> Store:
        store = EtcdStore(
            endpoints or server.endpoints_text, job_id or fresh_job_id(), security=security
        )
        made.append(store)
        return store

    return make


@pytest.fixture(scope="session")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    """One etcd with TLS, client-certificate auth and etcd's auth on (root and job users)."""
    server = start_tls_etcd(tmp_path_factory.mktemp("tls-etcd"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["etcd", "etcd-tls"])
def store_factory(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StoreFactory]:
    """Makes stores of one implementation (the contract suite runs once per implementation):
    plain etcd, and etcd over TLS with a client certificate and etcd's auth (as root, whose
    settings are also in the environment for the processes a test starts)."""
    made: list[Store] = []
    if request.param == "etcd":
        yield _etcd_store_factory(request.getfixturevalue("etcd_server"), made)
    else:
        tls: TlsEtcd = request.getfixturevalue("tls_etcd")
        for variable, value in tls.root.to_environment().items():
            if value is not None:
                monkeypatch.setenv(variable, value)
        yield _etcd_store_factory(tls.server, made, tls.root)
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
