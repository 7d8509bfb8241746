"""The `elastic-run` command line, run as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from elastic_allreduce.errors import StoreUnavailableError
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from elastic_allreduce.store.embedded import free_port
from tests.conftest import ROOT, fresh_job_id, write_raw

ELASTIC_RUN = str(Path(sys.executable).parent / "elastic-run")


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ELASTIC_RUN, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_help_lists_every_command() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("run", "join", "scale", "status", "etcd", "keys"):
        assert f"    {command} " in result.stdout, command
    for command in ("run", "join", "scale", "status", "etcd", "keys"):
        sub = run_cli(command, "--help")
        assert sub.returncode == 0, sub.stderr
        assert f"usage: elastic-run {command}" in sub.stdout


def test_unknown_command_and_missing_command_fail_with_usage() -> None:
    for args in ([], ["--workers", "two"], ["run", "--frobnicate"]):
        result = run_cli(*args)
        assert result.returncode == 2
        assert "usage: elastic-run" in result.stderr, (args, result.stderr)
    # A word that is no command is taken as the training command, and refused clearly.
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert "cannot run 'frobnicate': elastic-run runs Python training scripts" in result.stderr


def test_keys_prints_a_jobs_keys_as_json_lines(etcd_server: EmbeddedEtcd) -> None:
    job = fresh_job_id()
    with EtcdStore(etcd_server.endpoints_text, job) as store:
        store.put("members/a", {"host": "h1"})
        store.put("ring", {"epoch": 3})
        write_raw(store, "members/broken", b"oops")
    result = run_cli("keys", "--etcd", etcd_server.endpoints_text, "--job-id", job)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["key"] for r in records] == ["members/a", "members/broken", "ring"]
    assert records[0]["value"] == {"host": "h1"}
    assert "not UTF-8 JSON" in records[1]["malformed"]
    assert "3 keys at revision" in result.stderr
    only_members = run_cli(
        "keys", "--etcd", etcd_server.endpoints_text, "--job-id", job, "members/"
    )
    assert len(only_members.stdout.splitlines()) == 2


def test_keys_reports_bad_input_with_one_clear_line(etcd_server: EmbeddedEtcd) -> None:
    dead = f"127.0.0.1:{free_port()}"
    cases = {
        ("keys", "--job-id", "j"): "no etcd endpoint: pass --etcd HOST:PORT",
        ("keys", "--etcd", etcd_server.endpoints_text): "no job id: pass --job-id NAME",
        (
            "keys",
            "--etcd",
            "host:notaport",
            "--job-id",
            "j",
        ): "invalid etcd endpoint 'host:notaport'",
        ("keys", "--etcd", etcd_server.endpoints_text, "--job-id", "Bad_Job"): "invalid job id",
        ("keys", "--etcd", dead, "--job-id", "j"): f"etcd at {dead} is unreachable",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_ALLREDUCE_")}
    for args, expected in cases.items():
        result = subprocess.run(
            [ELASTIC_RUN, *args], capture_output=True, text=True, timeout=60, check=False, env=env
        )
        # 2: bad input; 3: an operational error (etcd unreachable), not the user's input.
        assert result.returncode == (3 if args[2] == dead else 2), (args, result.stderr)
        assert result.stderr.startswith("elastic-run keys: error: "), result.stderr
        assert expected in result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_etcd_command_serves_until_sigterm_prints_its_stacks_on_sigusr1_and_cleans_up(
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [ELASTIC_RUN, "etcd", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving on 127.0.0.1:" in line, line
        endpoint = line.rsplit("--etcd ", 1)[1].strip()
        proc.send_signal(signal.SIGUSR1)  # prints its stacks and goes on serving
        with EtcdStore(endpoint, "cli-job") as store:
            store.put("ring", 1)
            kv = store.get("ring")
            assert kv is not None and kv.value == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert proc.stderr is not None
        stacks = proc.stderr.read()
        assert "Current thread" in stacks and "_run_etcd" in stacks, stacks
        with EtcdStore(endpoint, "cli-job", request_timeout=1.0) as store:
            assert not _answers(store)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _answers(store: EtcdStore) -> bool:
    try:
        store.check()
    except StoreUnavailableError:
        return False
    return True
