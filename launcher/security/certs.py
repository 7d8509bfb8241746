"""Certificates for an etcd with TLS and client-certificate authentication (``elastic-run certs``).

For a test or a small cluster, not for a production PKI: one self-signed CA, one server
certificate that etcd uses both to serve clients and to talk to its peers (and, inside etcd, its
HTTP gateway to reach its own gRPC server, which is why the server certificate also carries the
*client auth* usage), and one client certificate per client (a job, the administrator).

A client certificate carries its name as organizational unit and has **no common name**: with
client-certificate authentication and etcd's auth both on, etcd's HTTP gateway (which
elastic-allreduce speaks) answers 400 to any client certificate with a common name, because it
cannot carry that identity to etcd's gRPC server. The certificate admits a client to the
server; the etcd user and password decide what it may read and write.

Keys are ECDSA P-256 (fast to make, accepted by etcd's Go TLS); private keys are written with
mode 0600 and never overwritten. An existing CA in the directory is reused, so client
certificates for new jobs can be added later with the same command.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elastic_allreduce.errors import ConfigError
from launcher.k8s.naming import ETCD_NAME, ETCD_PEER_SERVICE

CA_CERT: Final = "ca.crt"
CA_KEY: Final = "ca.key"
SERVER_CERT: Final = "server.crt"
SERVER_KEY: Final = "server.key"
#: The common name of the server certificate (client certificates have none).
SERVER_COMMON_NAME: Final = "elastic-allreduce-etcd-server"
#: Names a loopback etcd is reached by (tests, `elastic-run etcd --tls-dir`).
LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS: Final = 365
_CLIENT_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ClientFiles:
    """The certificate and key of one etcd user, and the CA that signed the server's."""

    cacert: Path
    cert: Path
    key: Path


def kubernetes_names(namespace: str) -> tuple[str, ...]:
    """The names the namespace's etcd (k8s/, ``--with-etcd``) is reached by: its client
    Service and every member's name under the peer Service."""
    return (
        ETCD_NAME,
        f"{ETCD_NAME}.{namespace}",
        f"{ETCD_NAME}.{namespace}.svc",
        f"{ETCD_NAME}.{namespace}.svc.cluster.local",
        f"*.{ETCD_PEER_SERVICE}.{namespace}.svc",
        f"*.{ETCD_PEER_SERVICE}.{namespace}.svc.cluster.local",
    )


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str | None, unit: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "elastic-allreduce")]
    if unit is not None:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    if common_name is not None:
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _alt_name(text: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        return x509.DNSName(text)


class CertificateAuthority:
    """A CA's certificate and key, loaded from or created in a directory."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key

    @classmethod
    def open(cls, directory: Path, days: int = DEFAULT_DAYS) -> CertificateAuthority:
        """The CA of ``directory`` (ca.crt + ca.key), created there if neither exists."""
        cert_path, key_path = directory / CA_CERT, directory / CA_KEY
        if cert_path.exists() != key_path.exists():
            raise ConfigError(
                f"{directory} has only one of {CA_CERT} and {CA_KEY}: restore the other or "
                "choose an empty directory"
            )
        if cert_path.exists():
            try:
                cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            except (OSError, ValueError, TypeError) as exc:
                raise ConfigError(f"cannot read the CA in {directory}: {exc}") from exc
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ConfigError(f"{key_path} is not an ECDSA key made by `elastic-run certs`")
            return cls(cert, key)
        key = _new_key()
        now = datetime.datetime.now(datetime.timezone.utc)
        name = _name("elastic-allreduce etcd CA")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        _write_key(key_path, key)
        _write_cert(cert_path, cert)
        return cls(cert, key)

    def issue(
        self,
        directory: Path,
        stem: str,
        *,
        server_names: Sequence[str] = (),
        days: int = DEFAULT_DAYS,
    ) -> tuple[Path, Path]:
        """Write ``stem.crt`` and ``stem.key`` signed by this CA: a client certificate (named
        ``stem`` in its organizational unit, no common name), or a server (and peer)
        certificate when ``server_names`` are given. Never overwrites."""
        cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        for path in (cert_path, key_path):
            if path.exists():
                raise ConfigError(
                    f"{path} exists already: delete it to make a new one, or use another name"
                )
        key = _new_key()
        now = datetime.datetime.now(datetime.timezone.utc)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server_names:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(SERVER_COMMON_NAME) if server_names else _name(None, stem))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.cert.public_key()),  # type: ignore[arg-type]
                critical=False,
            )
        )
        if server_names:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_alt_name(n) for n in server_names]), critical=False
            )
        cert = builder.sign(self.key, hashes.SHA256())
        _write_key(key_path, key)
        _write_cert(cert_path, cert)
        return cert_path, key_path


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(item for item in items if item))


def make_certificates(
    directory: Path,
    *,
    server_names: Sequence[str] = (),
    namespace: str | None = None,
    clients: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
) -> list[Path]:
    """Create (or reuse) the CA in ``directory``, the server certificate if it is missing (for
    loopback, ``server_names`` and, with ``namespace``, the namespace's etcd on Kubernetes), and
    one client certificate per name in ``clients``. Returns the files written."""
    if days < 1:
        raise ConfigError(f"--days must be at least 1, got {days}")
    for client in clients:
        if not _CLIENT_NAME.match(client) or client in ("ca", "server"):
            raise ConfigError(
                f"invalid client name {client!r}: use 1-64 letters, digits, '.', '_' or '-' "
                "(not 'ca' or 'server'), for example the job's id"
            )
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    authority = CertificateAuthority.open(directory, days)
    if not (directory / SERVER_CERT).exists():
        names = [*LOOPBACK_NAMES, *server_names]
        if namespace is not None:
            names += kubernetes_names(namespace)
        authority.issue(directory, "server", server_names=_unique(names), days=days)
    elif server_names or namespace:
        raise ConfigError(
            f"{directory / SERVER_CERT} exists already: delete server.crt and server.key to make "
            "one with other names"
        )
    for client in _unique(clients):
        authority.issue(directory, client, days=days)
    return sorted(set(directory.iterdir()) - before)


def client_files(directory: Path, user: str) -> ClientFiles:
    """The files ``make_certificates(directory, clients=[user])`` wrote for ``user``."""
    return ClientFiles(directory / CA_CERT, directory / f"{user}.crt", directory / f"{user}.key")
