"""A private etcd with TLS, client-certificate authentication and etcd's auth, for tests.

The certificates come from ``elastic-run certs``' own code (launcher.security.certs) and the users
from ``elastic-run etcd-user``'s (launcher.security.etcd_auth), so the tests exercise what users
run.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from elastic_allreduce.store import EmbeddedEtcd, EtcdSecurity, EtcdStore, ServerTls
from launcher.security import certs, etcd_auth

ROOT_PASSWORD = "root-password-for-tests"  # noqa: S105 - a throwaway etcd's


@dataclass(frozen=True)
class TlsEtcd:
    """A running TLS etcd, the directory of its certificates, and root's settings."""

    server: EmbeddedEtcd
    directory: Path

    @property
    def endpoints(self) -> str:
        return self.server.endpoints_text

    def client(self, name: str, *, user: str | None = None) -> EtcdSecurity:
        """Settings with the client certificate ``name`` (made if missing) and etcd user
        ``user`` (its password file is ``<user>.password`` in the directory)."""
        files = certs.client_files(self.directory, name)
        if not files.cert.exists():
            certs.make_certificates(self.directory, clients=[name])
        password_file = self.directory / f"{user}.password" if user else None
        return EtcdSecurity(
            cacert=str(files.cacert),
            cert=str(files.cert),
            key=str(files.key),
            user=user,
            password_file=str(password_file) if password_file else None,
        )

    @property
    def root(self) -> EtcdSecurity:
        return self.client("root", user=etcd_auth.ROOT_USER)

    def add_job(self, job_id: str) -> EtcdSecurity:
        """A user (and client certificate) for job ``job_id`` that may use only its keys."""
        password, _ = etcd_auth.read_or_create_password(self.directory / f"{job_id}.password")
        with EtcdStore(self.endpoints, job_id, security=self.root) as admin:
            etcd_auth.grant_job(admin, job_id, password)
        return self.client(job_id, user=job_id)

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_tls_etcd(directory: Path, *, auth: bool = True) -> TlsEtcd:
    """Certificates in ``directory``, a TLS etcd that requires client certificates, and (with
    ``auth``) etcd's auth turned on with root's password in ``root.password``."""
    certs.make_certificates(directory, clients=["root"])
    (directory / "root.password").write_text(ROOT_PASSWORD + "\n")
    server = EmbeddedEtcd(
        directory / "etcd",
        tls=ServerTls(
            directory / certs.SERVER_CERT,
            directory / certs.SERVER_KEY,
            directory / certs.CA_CERT,
        ),
    )
    tls_etcd = TlsEtcd(server, directory)
    try:
        server.start()
        if auth:
            with EtcdStore(tls_etcd.endpoints, "admin", security=tls_etcd.root) as admin:
                etcd_auth.enable_auth(admin)
    except BaseException:
        tls_etcd.close()
        raise
    return tls_etcd
