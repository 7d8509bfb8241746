"""How an etcd client checks etcd's identity and proves its own: TLS files and etcd credentials.

:class:`EtcdSecurity` holds the settings of ``--etcd-cacert / --etcd-cert / --etcd-key`` (the
names etcdctl uses) and ``--etcd-user / --etcd-password-file``. Every process of a job opens its
own store, so the settings also travel as environment variables (:mod:`elastic_allreduce.env`):
the command line exports them, and the agents and training processes it starts read them back
with :meth:`EtcdSecurity.from_environment`. Files are named, never copied into the environment;
a password is read from its file when a store is opened.

:meth:`EtcdSecurity.ssl_context` loads and checks the files up front, so a missing file, a file
that is not PEM, or a certificate whose key is another's is one ConfigError at start, not a
failure deep inside the first request.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError

#: The flag and environment variable of each field, as messages name them.
_SOURCES: Final = {
    "cacert": ("--etcd-cacert", env.ETCD_CACERT),
    "cert": ("--etcd-cert", env.ETCD_CERT),
    "key": ("--etcd-key", env.ETCD_KEY),
    "user": ("--etcd-user", env.ETCD_USER),
    "password_file": ("--etcd-password-file", env.ETCD_PASSWORD_FILE),
    "password": ("(no flag)", env.ETCD_PASSWORD),
}


def describe_source(name: str) -> str:
    """How a field is set, for messages: ``--etcd-cacert ($ELASTIC_ALLREDUCE_ETCD_CACERT)``."""
    flag, variable = _SOURCES[name]
    return f"{flag} (${variable})"


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS files and etcd credentials of one etcd client; all empty means plain HTTP without
    authentication (the private loopback etcd of ``--standalone`` and the tests)."""

    #: The CA that signed etcd's server certificate; None: the system's CAs.
    cacert: str | None = None
    #: This client's certificate and key, for an etcd that runs with --client-cert-auth.
    cert: str | None = None
    key: str | None = None
    #: An etcd user (etcd's auth): its role decides which keys this client may read and write.
    user: str | None = None
    password_file: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
        """The settings in the ``ELASTIC_ALLREDUCE_ETCD_*`` variables (empty ones are unset)."""
        environ = os.environ if environ is None else environ

        def get(variable: str) -> str | None:
            return environ.get(variable) or None

        return cls(
            cacert=get(env.ETCD_CACERT),
            cert=get(env.ETCD_CERT),
            key=get(env.ETCD_KEY),
            user=get(env.ETCD_USER),
            password_file=get(env.ETCD_PASSWORD_FILE),
            password=get(env.ETCD_PASSWORD),
        )

    def to_environment(self) -> dict[str, str | None]:
        """Each variable of :data:`env.ETCD_SECURITY` with its value, None for the unset ones
        (a parent removes those from the environment of the processes it starts)."""
        return {
            env.ETCD_CACERT: self.cacert,
            env.ETCD_CERT: self.cert,
            env.ETCD_KEY: self.key,
            env.ETCD_USER: self.user,
            env.ETCD_PASSWORD_FILE: self.password_file,
            env.ETCD_PASSWORD: self.password,
        }

    @property
    def empty(self) -> bool:
        """Whether nothing is set (plain HTTP, no authentication)."""
        return self == EtcdSecurity()

    @property
    def has_tls_files(self) -> bool:
        return any((self.cacert, self.cert, self.key))

    def check(self, *, tls: bool) -> None:
        """Raise ConfigError for settings that cannot work together (the files are checked by
        :meth:`ssl_context`, the password file by :meth:`read_password`)."""
        if (self.cert is None) != (self.key is None):
            given, missing = ("cert", "key") if self.key is None else ("key", "cert")
            raise ConfigError(
                f"{describe_source(given)} is set but {describe_source(missing)} is not: a client "
                "certificate needs both its certificate and its key"
            )
        if self.has_tls_files and not tls:
            raise ConfigError(
                "--etcd-cacert, --etcd-cert and --etcd-key are for etcd over TLS: give the "
                "endpoints as https://HOST:PORT (or unset the ELASTIC_ALLREDUCE_ETCD_CACERT, "
                "_CERT and _KEY variables for a plain etcd)"
            )
        if self.password_file is not None and self.password is not None:
            raise ConfigError(
                f"both {describe_source('password_file')} and ${env.ETCD_PASSWORD} are set: "
                "give the password one way"
            )
        has_password = self.password_file is not None or self.password is not None
        if self.user is None and has_password:
            raise ConfigError(
                f"an etcd password is given but no user: pass {describe_source('user')}"
            )
        if self.user is not None and not has_password:
            raise ConfigError(
                f"etcd user {self.user!r} has no password: pass {describe_source('password_file')}"
            )

    def read_password(self) -> str | None:
        """The password (the file's first line), None without a user; ConfigError if unreadable."""
        if self.password is not None or self.password_file is None:
            return self.password
        path = self.password_file
        try:
            with open(path, encoding="utf-8") as file:
                password = file.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"cannot read {describe_source('password_file')} {path!r}: {_reason(exc)}"
            ) from exc
        if not password:
            raise ConfigError(f"{describe_source('password_file')} {path!r} is empty")
        return password

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context that verifies etcd against ``cacert`` (or the system's CAs),
        checks its host name, and presents ``cert``; ConfigError names a bad file."""
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{describe_source(name)} {path!r}: no such file")
        try:
            context = ssl.create_default_context(cafile=self.cacert)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"{describe_source('cacert')} {self.cacert!r} is not a PEM CA certificate: "
                f"{_reason(exc)}"
            ) from exc
        if self.cert is not None and self.key is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as exc:
                if "KEY_VALUES_MISMATCH" in str(exc):
                    raise ConfigError(
                        f"{describe_source('cert')} {self.cert!r} and {describe_source('key')} "
                        f"{self.key!r} do not belong together: the key is not the certificate's"
                    ) from exc
                raise ConfigError(
                    f"{describe_source('cert')} {self.cert!r} or {describe_source('key')} "
                    f"{self.key!r} is not a PEM certificate and unencrypted key: {_reason(exc)}"
                ) from exc
        return context


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
