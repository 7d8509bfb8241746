"""The certificates and keys of the test cluster (:mod:`tests.helpers.kube.cluster`).

One CA signs everything: the API server's serving certificate and the client certificates of
the admin, the scheduler, the controller manager and the process kubelet. Kubernetes takes a
client certificate's CN as the user name and its O entries as the groups. The service-account
key pair signs (private key: API server and controller manager) and verifies (public key)
service-account tokens. Keys are ECDSA P-256: generated in milliseconds, accepted everywhere
(serving, client and service-account signing, as ES256).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Validity of every certificate (a test cluster lives for minutes to days).
VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class KeyPair:
    """A certificate (or public key) file and its private key file."""

    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    parts.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(parts)


class ClusterPki:
    """Makes the cluster's CA, certificates and service-account keys in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("elastic-allreduce-test-cluster-ca")
        self._ca_cert = (
            self._builder(ca_name, self._ca_key.public_key())
            .issuer_name(ca_name)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(self._usage(cert_sign=True), critical=True)
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca = self._save("ca", self._ca_cert, self._ca_key)

    def _builder(
        self, subject: x509.Name, public: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now)
            .not_valid_after(self._now + VALIDITY)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        )

    @staticmethod
    def _usage(*, cert_sign: bool) -> x509.KeyUsage:
        return x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=cert_sign,
            crl_sign=cert_sign,
            encipher_only=False,
            decipher_only=False,
        )

    def _save(self, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KeyPair:
        pair = KeyPair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair

    def _issue(
        self,
        stem: str,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        *,
        dns: Sequence[str] = (),
        ips: Sequence[str] = (),
    ) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            self._builder(subject, key.public_key())
            .issuer_name(self._ca_cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(self._usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()),
                critical=False,
            )
        )
        if dns or ips:
            names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns]
            names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return self._save(stem, builder.sign(self._ca_key, hashes.SHA256()), key)

    def server(
        self, stem: str, common_name: str, *, dns: Sequence[str], ips: Sequence[str]
    ) -> KeyPair:
        """A serving certificate for the given names and addresses."""
        return self._issue(
            stem, _name(common_name), ExtendedKeyUsageOID.SERVER_AUTH, dns=dns, ips=ips
        )

    def client(self, stem: str, user: str, groups: Sequence[str] = ()) -> KeyPair:
        """A client certificate: Kubernetes user ``user`` in ``groups``."""
        return self._issue(stem, _name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH)

    def service_account_keys(self, stem: str = "sa") -> KeyPair:
        """The service-account token signing key (``.key``) and its public key (``.pub``)."""
        key = ec.generate_private_key(ec.SECP256R1())
        pair = KeyPair(self.directory / f"{stem}.pub", self.directory / f"{stem}.key")
        pair.cert.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        _write_key(key, pair.key)
        return pair
