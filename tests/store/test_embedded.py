"""The private etcd server: start, health, restart on the same data, clean stop, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_allreduce.errors import EtcdServerError
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from elastic_allreduce.store.embedded import find_etcd_binary, free_port, free_ports


def test_two_servers_run_side_by_side_and_data_survives_a_restart(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "one") as one, EmbeddedEtcd() as two:
        assert one.endpoint != two.endpoint
        store_one = EtcdStore(one.endpoints_text, "job-a")
        store_two = EtcdStore(two.endpoints_text, "job-a")
        store_one.put("ring", {"epoch": 7})
        assert store_two.get("ring") is None
        endpoint = one.endpoint
        one.stop()
        assert one.pid is None
        one.restart()
        assert one.endpoint == endpoint
        kv = store_one.get("ring")
        assert kv is not None and kv.value == {"epoch": 7}
        assert store_one.check().startswith("3.")
    assert (tmp_path / "one").exists()  # a caller-provided data dir is kept


def test_close_removes_a_temporary_data_dir_and_the_process() -> None:
    server = EmbeddedEtcd().start()
    pid, data_dir = server.pid, server.data_dir
    assert pid is not None and data_dir.exists()
    server.close()
    assert not data_dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_taken_fixed_port_gives_a_clear_error(etcd_server: EmbeddedEtcd) -> None:
    server = EmbeddedEtcd(client_port=etcd_server.client_port)
    try:
        with pytest.raises(EtcdServerError, match="address already in use"):
            server.start(timeout=10)
    finally:
        server.close()


def test_a_missing_binary_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_ALLREDUCE_ETCD_BIN", "/nonexistent/etcd")
    with pytest.raises(EtcdServerError, match="not an executable file"):
        find_etcd_binary()
    monkeypatch.delenv("ELASTIC_ALLREDUCE_ETCD_BIN")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(EtcdServerError, match="run `make setup`"):
        find_etcd_binary()


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from elastic_allreduce.store import EmbeddedEtcd\n"
        f"server = EmbeddedEtcd({str(tmp_path / 'd')!r}).start()\n"
        "print(server.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    etcd_pid = int(parent.stdout.readline())
    os.kill(etcd_pid, 0)
    parent.kill()
    parent.wait(timeout=10)
    # PR_SET_PDEATHSIG delivers SIGKILL to etcd; it becomes a zombie of init or vanishes.
    probe = subprocess.run(
        [
            "sh",
            "-c",
            f"for i in $(seq 100); do [ -d /proc/{etcd_pid} ] && "
            f"! grep -q '^State:.*Z' /proc/{etcd_pid}/status || exit 0; "
            "sleep 0.05; done; exit 1",
        ],
        check=False,
        timeout=30,
    )
    assert probe.returncode == 0, f"etcd {etcd_pid} outlived its parent"


def test_free_port_returns_a_bindable_port() -> None:
    port = free_port()
    assert 0 < port < 65536


def test_free_ports_asked_for_together_are_all_different() -> None:
    """An etcd cluster's members need different ports: 500 asked for one at a time here came
    back with about ten repeated (a released port is soon handed out again), which once gave
    a cluster a "duplicate url"."""
    ports = free_ports(500)
    assert len(set(ports)) == 500
    assert all(0 < port < 65536 for port in ports)
