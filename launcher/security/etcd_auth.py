"""etcd's own authentication for elastic-allreduce jobs: the administrator's side.

etcd's auth has users, roles and key-range permissions. For each job, :func:`grant_job` makes a
role with read-write permission on the job's prefix only (``/elastic-allreduce/<job-id>/`` up to
its range end) and a user holding only that role, so one job's credentials can neither read nor
write another job's keys: etcd answers "permission denied". :func:`enable_auth` turns auth on,
creating etcd's ``root`` user (which keeps every right) with the administrator's password.

Both run as ``elastic-run etcd-user`` with root's credentials (the store's security settings).
Leases need no permission of their own in etcd 3.4; revoking one needs write permission on the
keys attached to it, which a job's user has for its own keys.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from elastic_allreduce.errors import ConfigError, StoreError
from elastic_allreduce.store import EtcdStore
from elastic_allreduce.store.etcd import prefix_end

log = logging.getLogger(__name__)

ROOT_USER = "root"


@dataclass(frozen=True)
class JobGrant:
    """What :func:`grant_job` set up: the user, its role and the key range it may use."""

    user: str
    role: str
    prefix: str
    created_user: bool


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _call_allowing(store: EtcdStore, path: str, payload: dict[str, object], exists: str) -> bool:
    """Make one admin call; False if etcd says the thing exists already (``exists``)."""
    try:
        store.transport.call(path, payload)
    except StoreError as exc:
        if exists in str(exc):
            return False
        raise
    return True


def enable_auth(store: EtcdStore) -> bool:
    """Turn etcd's auth on with the store's user, which must be root, and its password; False
    if auth was on already (and root's password is the one given)."""
    security = store.transport.security
    if security.user != ROOT_USER:
        raise ConfigError(
            "turning on etcd's auth creates its root user: pass --etcd-user root and "
            "--etcd-password-file with root's password"
        )
    if store.transport.signed_in():
        return False
    password = security.read_password()
    _call_allowing(
        store,
        "auth/user/add",
        {"name": ROOT_USER, "password": password},
        "user name already exists",
    )
    store.transport.call("auth/user/grant", {"user": ROOT_USER, "role": ROOT_USER})
    store.transport.call("auth/enable", {})
    store.transport.renew_token("")  # signed in without a token while auth was off
    log.info("%s: auth enabled", store.describe())
    return True


def require_auth(store: EtcdStore) -> None:
    """ConfigError unless etcd's auth is on and the store is signed in (as the admin)."""
    if not store.transport.signed_in():
        raise ConfigError(
            f"{store.describe()} does not have etcd's auth on (or no admin user was given): "
            "without it any client may read and write every job; add --enable-auth, with "
            "--etcd-user root and --etcd-password-file holding the root password to set"
        )


def grant_job(store: EtcdStore, user: str, password: str) -> JobGrant:
    """Give ``user`` (created, or its password changed) a role of its own with read-write
    permission on the store's job prefix and nothing else. The store signs in as root."""
    if not user or user == ROOT_USER:
        raise ConfigError(f"invalid job user {user!r}: use a name of its own, such as the job id")
    require_auth(store)
    role = user
    prefix = store.prefix
    _call_allowing(store, "auth/role/add", {"name": role}, "role name already exists")
    store.transport.call(
        "auth/role/grant",
        {
            "name": role,
            "perm": {
                "permType": "READWRITE",
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
            },
        },
    )
    created = _call_allowing(
        store, "auth/user/add", {"name": user, "password": password}, "user name already exists"
    )
    if not created:
        store.transport.call("auth/user/changepw", {"name": user, "password": password})
    store.transport.call("auth/user/grant", {"user": user, "role": role})
    return JobGrant(user, role, prefix, created)


def read_or_create_password(path: Path) -> tuple[str, bool]:
    """The password in ``path`` (its first line), or a new random one written there with mode
    0600; returns it and whether it was created."""
    if path.exists():
        try:
            password = path.read_text(encoding="utf-8").splitlines()[0].rstrip("\r\n")
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise ConfigError(f"cannot read a password from {path}: {exc}") from exc
        if not password:
            raise ConfigError(f"{path} holds no password on its first line")
        return password, False
    password = secrets.token_urlsafe(24)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create the password file {path}: {exc.strerror}") from exc
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(password + "\n")
    return password, True
