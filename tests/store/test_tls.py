"""etcd over TLS with client certificates and etcd's auth, against a real etcd that requires both.

The whole store contract also runs over TLS (``store_factory``'s ``etcd-tls``); these tests pin
what is particular to it: each refusal is one clear error saying what to change, one job's
credentials cannot touch another job's keys, tokens are renewed after a restart, and a process
started with the settings in its environment needs nothing else.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_allreduce.errors import ConfigError, StoreAuthError, StoreError
from elastic_allreduce.store import EtcdSecurity, EtcdStore, EventType, Watch, WatchEvent
from elastic_allreduce.store.etcd import parse_endpoints
from launcher.exit_codes import exit_code
from launcher.security import certs
from tests.conftest import ROOT, fresh_job_id
from tests.helpers.tls import TlsEtcd, start_tls_etcd


def next_event(watch: Watch, timeout: float = 10.0) -> WatchEvent:
    event = watch.get(timeout)
    assert event is not None, f"no watch event within {timeout} s"
    return event


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second CA with a client certificate "root": trusted by nobody here."""
    directory = tmp_path_factory.mktemp("other-ca")
    certs.make_certificates(directory, clients=["root"])
    return directory


def test_a_job_reads_writes_leases_and_watches_over_tls_with_its_own_user(
    tls_etcd: TlsEtcd,
) -> None:
    job = fresh_job_id("tls")
    with EtcdStore(tls_etcd.endpoints, job, security=tls_etcd.add_job(job)) as store:
        assert store.endpoints[0].tls
        assert store.describe().startswith("etcd at https://127.0.0.1:")
        assert store.check().startswith("3.")
        watch = store.watch_prefix("members/")
        lease = store.grant_lease(2)
        revision = store.put("members/a", {"host": "h"}, lease=lease)
        assert store.compare_and_swap("ring", {"epoch": 1}, expected_mod_revision=0)
        put = next_event(watch)
        assert (put.type, put.key, put.revision) == (EventType.PUT, "members/a", revision)
        assert store.lease_remaining(lease.id) is not None  # a takeover asks, as the job's user
        lease.revoke()  # needs write permission on the keys attached: the job's own
        deleted = next_event(watch)
        assert (deleted.type, deleted.key) == (EventType.DELETE, "members/a")
        assert [kv.key for kv in store.get_prefix()] == ["ring"]


def test_job_a_cannot_read_or_write_job_b_and_etcd_says_permission_denied(
    tls_etcd: TlsEtcd,
) -> None:
    job_a, job_b = fresh_job_id("a"), fresh_job_id("b")
    security_a, security_b = tls_etcd.add_job(job_a), tls_etcd.add_job(job_b)
    with (
        EtcdStore(tls_etcd.endpoints, job_b, security=security_b) as own,
        EtcdStore(tls_etcd.endpoints, job_b, security=security_a) as intruder,
    ):
        own.put("config/job", {"command": ["python", "train.py"]})
        denied = f"permission denied on key '/elastic-allreduce/{job_b}/config/job'"
        for attempt in (
            lambda: intruder.get("config/job"),
            lambda: intruder.put("config/job", {"command": ["rm", "-rf", "/"]}),
            lambda: intruder.compare_and_swap("ring", {"epoch": 9}, expected_mod_revision=0),
            lambda: intruder.delete("config/job"),
            intruder.get_prefix,
        ):
            with pytest.raises(StoreAuthError, match="permission denied") as caught:
                attempt()
            assert f"for etcd user {job_a!r}" in str(caught.value)
        with pytest.raises(StoreAuthError, match=denied):
            intruder.get("config/job")
        assert exit_code(caught.value) == 2
        # A watch on the other job's keys is refused too, not silently empty.
        watch = intruder.watch_prefix("", start_revision=1)
        with pytest.raises(StoreAuthError, match="permission denied on keys from"):
            watch.get(10.0)
        kv = own.get("config/job")
        assert kv is not None and kv.value == {"command": ["python", "train.py"]}
        assert [kv.key for kv in own.get_prefix()] == ["config/job"]


def test_a_wrong_ca_is_one_clear_error(tls_etcd: TlsEtcd, other_ca: Path) -> None:
    job = fresh_job_id()
    wrong = dataclasses.replace(tls_etcd.add_job(job), cacert=str(other_ca / certs.CA_CERT))
    with (
        EtcdStore(tls_etcd.endpoints, job, security=wrong) as store,
        pytest.raises(StoreAuthError) as caught,
    ):
        store.check()
    message = str(caught.value)
    assert f"etcd at {tls_etcd.endpoints} presented a certificate that" in message
    assert f"--etcd-cacert ($ELASTIC_ALLREDUCE_ETCD_CACERT) '{other_ca / 'ca.crt'}'" in message
    assert "does not verify (unable to get local issuer certificate)" in message
    assert exit_code(caught.value) == 2


def test_no_client_certificate_is_one_clear_error(tls_etcd: TlsEtcd) -> None:
    job = fresh_job_id()
    without = dataclasses.replace(tls_etcd.add_job(job), cert=None, key=None)
    with (
        EtcdStore(tls_etcd.endpoints, job, security=without) as store,
        pytest.raises(StoreAuthError, match="it requires a client certificate; pass --etcd-cert"),
    ):
        store.get("ring")


def test_a_client_certificate_from_another_ca_is_refused(tls_etcd: TlsEtcd, other_ca: Path) -> None:
    job = fresh_job_id()
    foreign = dataclasses.replace(
        tls_etcd.add_job(job), cert=str(other_ca / "root.crt"), key=str(other_ca / "root.key")
    )
    with (
        EtcdStore(tls_etcd.endpoints, job, security=foreign) as store,
        pytest.raises(StoreAuthError, match=r"refused the client certificate '.*/root\.crt'"),
    ):
        store.get("ring")


def test_wrong_or_missing_credentials_are_clear_errors(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    job = fresh_job_id()
    security = tls_etcd.add_job(job)
    wrong_password = tmp_path / "wrong"
    wrong_password.write_text("not-the-password\n")
    cases = {
        "wrong user name or password": dataclasses.replace(
            security, password_file=str(wrong_password)
        ),
        "has authentication enabled: pass --etcd-user": dataclasses.replace(
            security, user=None, password_file=None
        ),
    }
    for expected, settings in cases.items():
        with (
            EtcdStore(tls_etcd.endpoints, job, security=settings) as store,
            pytest.raises(StoreAuthError, match=expected),
        ):
            store.get("ring")


def test_bad_settings_are_config_errors_before_any_request(
    tls_etcd: TlsEtcd, tmp_path: Path
) -> None:
    job = fresh_job_id()
    good = tls_etcd.add_job(job)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    cases = {
        "no such file": dataclasses.replace(good, cacert=str(tmp_path / "missing.crt")),
        "is not a PEM CA certificate": dataclasses.replace(good, cacert=str(not_pem)),
        "do not belong together: the key is not the certificate's": dataclasses.replace(
            good, key=str(tls_etcd.directory / "root.key")
        ),
        "is set but --etcd-key": dataclasses.replace(good, key=None),
        "has no password": dataclasses.replace(good, password_file=None),
        "is empty": dataclasses.replace(good, password_file=str(tmp_path / "empty")),
    }
    (tmp_path / "empty").write_text("")
    for expected, settings in cases.items():
        with pytest.raises(ConfigError, match=expected) as caught:
            EtcdStore(tls_etcd.endpoints, job, security=settings)
        assert not isinstance(caught.value, StoreError), expected
    plain = tls_etcd.endpoints.removeprefix("https://")
    with pytest.raises(ConfigError, match="give the endpoints as https://"):
        EtcdStore(plain, job, security=good)
    with pytest.raises(ConfigError, match="mix http:// and https://"):
        parse_endpoints(f"{tls_etcd.endpoints},{plain}")


def test_a_plain_client_of_a_tls_etcd_is_told_to_use_https(tls_etcd: TlsEtcd) -> None:
    plain = tls_etcd.endpoints.removeprefix("https://")
    with (
        EtcdStore(plain, fresh_job_id(), security=EtcdSecurity(), request_timeout=2.0) as store,
        pytest.raises(StoreError, match=r"if it serves TLS, pass --etcd https://"),
    ):
        store.check()


def test_tokens_are_renewed_after_a_restart_and_a_watch_resumes(tmp_path: Path) -> None:
    """etcd forgets every auth token when it restarts: a store signs in again once, and a watch
    reconnects with a new token without losing an event."""
    server = start_tls_etcd(tmp_path / "tls")
    try:
        job = fresh_job_id()
        security = server.add_job(job)
        with (
            EtcdStore(server.endpoints, job, security=security) as writer,
            EtcdStore(server.endpoints, job, security=security) as watcher,
        ):
            watch = watcher.watch_prefix("status/")
            writer.put("status/a", 1)
            assert next_event(watch).key == "status/a"
            server.server.stop()
            server.server.restart()
            writer.put("status/b", 2)  # the writer's token is unknown now: it signs in again
            assert next_event(watch, timeout=15).key == "status/b"
            kv = watcher.get("status/b")
            assert kv is not None and kv.value == 2
    finally:
        server.close()


def test_a_process_reads_the_settings_from_its_environment(
    tls_etcd: TlsEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How agents and training processes open their stores: EtcdStore(endpoints, job) only."""
    job = fresh_job_id()
    security = tls_etcd.add_job(job)
    for variable, value in security.to_environment().items():
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    assert EtcdSecurity.from_environment() == security
    code = (
        "import sys; from elastic_allreduce.store import EtcdStore; "
        "s = EtcdStore(sys.argv[1], sys.argv[2]); print(s.put('status/x', 1) > 0); s.close()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, tls_etcd.endpoints, job],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
    with EtcdStore(tls_etcd.endpoints, job, security=security) as store:
        assert store.get("status/x") is not None
