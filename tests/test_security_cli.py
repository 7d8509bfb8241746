"""`elastic-run certs`, `elastic-run etcd-user` and the etcd TLS and auth flags of the commands."""

from __future__ import annotations

import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from launcher.cli import main
from launcher.security import certs
from tests.conftest import ROOT, fresh_job_id
from tests.helpers.tls import TlsEtcd, start_tls_etcd
from tests.integration.harness import HVD_SCRIPT
from tests.test_cli import ELASTIC_RUN


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_makes_a_ca_a_server_and_clients_and_reuses_the_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "certs"
    assert main(["certs", str(directory), "--client", "root", "--host", "etcd.example"]) == 0
    out = capsys.readouterr().out
    assert f"--etcd-cacert {directory / 'ca.crt'} --etcd-cert {directory / 'root.crt'}" in out
    names = {"ca.crt", "ca.key", "server.crt", "server.key", "root.crt", "root.key"}
    assert {p.name for p in directory.iterdir()} == names
    for key in ("ca.key", "server.key", "root.key"):
        assert stat.S_IMODE((directory / key).stat().st_mode) == 0o600, key
    ca, server, client = (load(directory / n) for n in ("ca.crt", "server.crt", "root.crt"))
    alt = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "etcd.example"} <= set(alt.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in alt.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # etcd's gateway reaches its own gRPC server with the server certificate: client auth too.
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    # No common name on a client certificate: etcd's gateway refuses those while auth is on.
    assert not client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    assert client.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == (
        "root"
    )
    assert client.issuer == server.issuer == ca.subject

    # A second run adds a client signed by the same CA and touches nothing else.
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert main(["certs", str(directory), "--client", "job-7"]) == 0
    after = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert set(after) - set(before) == {"job-7.crt", "job-7.key"}
    assert all(after[name] == data for name, data in before.items())
    assert load(directory / "job-7.crt").issuer == ca.subject

    # Nothing is ever overwritten; bad names are refused: one line, exit 2.
    assert main(["certs", str(directory), "--client", "root"]) == 2
    assert "root.crt exists already" in capsys.readouterr().err
    assert main(["certs", str(directory), "--client", "../x"]) == 2
    assert "invalid client name '../x'" in capsys.readouterr().err


def test_certs_for_kubernetes_names_the_namespaces_etcd(tmp_path: Path) -> None:
    assert main(["certs", str(tmp_path), "--namespace", "team-a"]) == 0
    alt = load(tmp_path / "server.crt").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    names = set(alt.value.get_values_for_type(x509.DNSName))
    assert {
        "elastic-allreduce-etcd",
        "elastic-allreduce-etcd.team-a.svc",
        "*.elastic-allreduce-etcd-peer.team-a.svc",
    } <= names


@pytest.fixture
def fresh_tls_etcd(tmp_path: Path) -> Iterator[TlsEtcd]:
    """A TLS etcd of this test's own with etcd's auth still off."""
    server = start_tls_etcd(tmp_path / "tls", auth=False)
    try:
        yield server
    finally:
        server.close()


def store_flags(server: TlsEtcd, client: str, user: str, password: Path) -> list[str]:
    files = certs.client_files(server.directory, client)
    return [
        *("--etcd", server.endpoints),
        *("--etcd-cacert", str(files.cacert)),
        *("--etcd-cert", str(files.cert), "--etcd-key", str(files.key)),
        *("--etcd-user", user, "--etcd-password-file", str(password)),
    ]


def test_etcd_user_turns_auth_on_and_confines_a_job_to_its_keys(
    fresh_tls_etcd: TlsEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fresh_tls_etcd
    root = store_flags(server, "root", "root", server.directory / "root.password")
    job_a, job_b = fresh_job_id("a"), fresh_job_id("b")
    password_a = tmp_path / "a.password"

    # With auth off a job user would protect nothing: refused unless --enable-auth.
    code = main(["etcd-user", *root, "--job-id", job_a, "--job-password-file", str(password_a)])
    assert code == 2
    assert "does not have etcd's auth on" in capsys.readouterr().err
    assert not password_a.exists()

    enable = ["--enable-auth", "--job-id", job_a, "--job-password-file", str(password_a)]
    code = main(["etcd-user", *root, *enable])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "auth is now on" in out
    assert f"role {job_a} may read and write /elastic-allreduce/{job_a}/ only" in out
    assert stat.S_IMODE(password_a.stat().st_mode) == 0o600
    assert main(["certs", str(server.directory), "--client", job_a]) == 0
    capsys.readouterr()

    as_a = store_flags(server, job_a, job_a, password_a)
    assert main(["keys", *as_a, "--job-id", job_a]) == 0
    assert "# 0 keys at revision" in capsys.readouterr().err
    assert main(["keys", *as_a, "--job-id", job_b]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"permission denied on keys from '/elastic-allreduce/{job_b}/'" in err[0]
    assert f"for etcd user {job_a!r}" in err[0]
    # Without credentials, etcd with auth on says what to pass.
    no_user = as_a[: as_a.index("--etcd-user")]
    assert main(["keys", *no_user, "--job-id", job_a]) == 2
    assert "has authentication enabled: pass --etcd-user" in capsys.readouterr().err

    # Run again: the user keeps its name and gets the file's password; nothing else changes.
    code = main(["etcd-user", *root, "--job-id", job_a, "--job-password-file", str(password_a)])
    assert code == 0
    assert f"etcd user {job_a} updated" in capsys.readouterr().out
    assert main(["keys", *as_a, "--job-id", job_a]) == 0


def test_security_flags_without_etcd_are_refused_the_private_etcd_stays_plain() -> None:
    done = subprocess.run(
        [ELASTIC_RUN, "--etcd-cacert", "ca.crt", "--", "python", HVD_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "elastic-run run: error: --etcd-cacert without --etcd: the private etcd of --standalone "
        "is plain HTTP on loopback; pass --etcd https://HOST:PORT for an etcd with TLS"
    )


def test_k8s_render_runs_etcd_with_tls_unless_told_plaintext(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def render(*extra: str) -> list[dict[str, Any]]:
        code = main(["k8s", "render", "--image", "ea:1", "--job-id", "j1", "--with-etcd", *extra])
        assert code == 0
        out = capsys.readouterr().out
        return [doc for doc in yaml.safe_load_all(out) if doc]

    def etcd_urls(objects: list[dict[str, Any]]) -> str:
        [statefulset] = [o for o in objects if o["kind"] == "StatefulSet"]
        [container] = statefulset["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in container["env"]}["ETCD_LISTEN_CLIENT_URLS"]

    def launcher_args(objects: list[dict[str, Any]]) -> list[str]:
        [job] = [o for o in objects if o["kind"] == "Job"]
        return list(job["spec"]["template"]["spec"]["containers"][0]["args"])

    tls = render("--", "python", "train.py")
    assert etcd_urls(tls) == "https://0.0.0.0:2379"
    args = launcher_args(tls)
    assert args[args.index("--etcd") + 1] == "https://elastic-allreduce-etcd:2379"
    assert args[args.index("--etcd-user") + 1] == "j1"
    plain = render("--etcd-plaintext", "--", "python", "train.py")
    assert etcd_urls(plain) == "http://0.0.0.0:2379"
    args = launcher_args(plain)
    assert args[args.index("--etcd") + 1] == "elastic-allreduce-etcd:2379"
    assert "--etcd-cacert" not in args
