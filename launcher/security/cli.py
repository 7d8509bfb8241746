"""The etcd security flags of every ``elastic-run`` command, and ``certs`` and ``etcd-user``.

- :func:`add_security_flags`: ``--etcd-cacert / --etcd-cert / --etcd-key`` (etcdctl's names)
  and ``--etcd-user / --etcd-password-file``, each defaulting to its environment variable;
  :func:`security_from_args` reads them back, :func:`export_security` puts them into this
  process's environment so that the agents and training processes it starts use them too.
- ``elastic-run certs DIR``: a CA, a server certificate and client certificates
  (:mod:`launcher.security.certs`).
- ``elastic-run etcd-user``: with root's credentials, turn on etcd's auth (``--enable-auth``)
  and give a job a user whose role may read and write that job's keys only
  (:mod:`launcher.security.etcd_auth`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from elastic_allreduce import env
from elastic_allreduce.records.keys import validate_job_id
from elastic_allreduce.store import EtcdSecurity, EtcdStore
from launcher.security import certs, etcd_auth

#: (flag, attribute, environment variable, metavar, help) of each security flag.
_FLAGS: Final = (
    ("--etcd-cacert", "etcd_cacert", env.ETCD_CACERT, "FILE", "CA of etcd's server certificate"),
    ("--etcd-cert", "etcd_cert", env.ETCD_CERT, "FILE", "this client's TLS certificate"),
    ("--etcd-key", "etcd_key", env.ETCD_KEY, "FILE", "the key of --etcd-cert"),
    ("--etcd-user", "etcd_user", env.ETCD_USER, "NAME", "the etcd user to sign in as"),
    (
        "--etcd-password-file",
        "etcd_password_file",
        env.ETCD_PASSWORD_FILE,
        "FILE",
        f"its password, the file's first line (or ${env.ETCD_PASSWORD} itself)",
    ),
)

_GROUP_HELP: Final = (
    "etcd over TLS (--etcd https://...) and etcd's own auth; each flag defaults to its "
    "variable (for `run`: only with --etcd; the private etcd needs none), and the processes a "
    "command starts get the same settings"
)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Add the etcd TLS and auth flags (values None unless given: see security_from_args)."""
    group = parser.add_argument_group("etcd TLS and auth", _GROUP_HELP)
    for flag, dest, variable, metavar, text in _FLAGS:
        group.add_argument(flag, dest=dest, metavar=metavar, help=f"{text} (default: ${variable})")


def given_security_flags(args: argparse.Namespace) -> list[str]:
    """The security flags given on the command line."""
    return [flag for flag, dest, *_ in _FLAGS if getattr(args, dest, None) is not None]


def security_from_args(args: argparse.Namespace) -> EtcdSecurity:
    """The flags' settings, each missing one taken from its variable; file paths absolute (the
    processes this command starts may run elsewhere in the file system)."""
    base = EtcdSecurity.from_environment()

    def path(value: str | None) -> str | None:
        return os.path.abspath(value) if value else None

    password_file = args.etcd_password_file or base.password_file
    return EtcdSecurity(
        cacert=path(args.etcd_cacert or base.cacert),
        cert=path(args.etcd_cert or base.cert),
        key=path(args.etcd_key or base.key),
        user=args.etcd_user or base.user,
        password_file=path(password_file),
        password=None if args.etcd_password_file else base.password,
    )


def export_security(security: EtcdSecurity) -> None:
    """Set this process's ``ELASTIC_ALLREDUCE_ETCD_*`` variables to ``security`` (unset the
    others), so that every process it starts opens its store the same way."""
    for variable, value in security.to_environment().items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value


# -- elastic-run certs -------------------------------------------------------------------------

_CERTS_DESCRIPTION = """\
Create the certificates of an etcd with TLS and client-certificate authentication, for a test
or a small cluster: in DIR a CA (ca.crt, ca.key; reused if present), a server certificate
(server.crt, server.key; for loopback, every --host and, with --namespace, the namespace's etcd
on Kubernetes) and one client certificate per --client (NAME.crt, NAME.key). Keys are written
with mode 0600 and never overwritten. Run it again with new --client names to add clients.

etcd then runs with --cert-file DIR/server.crt --key-file DIR/server.key --client-cert-auth
--trusted-ca-file DIR/ca.crt, and a client passes --etcd https://HOST:PORT --etcd-cacert
DIR/ca.crt --etcd-cert DIR/NAME.crt --etcd-key DIR/NAME.key (docs/store.md).
"""

_ETCD_USER_DESCRIPTION = """\
Give a job its own etcd user: a role with read-write permission on the job's keys
(/elastic-allreduce/JOB/) and nothing else, and a user with that role whose password is the
first line of --job-password-file (created with a random password if the file does not exist).
Run it with etcd's root user (--etcd-user root --etcd-password-file ROOT_PASSWORD_FILE).
--enable-auth first turns etcd's auth on, creating root with that password, if it is off.
Then start the job with --etcd-user JOB_USER --etcd-password-file JOB_PASSWORD_FILE.
"""


def add_parsers(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
    add_store_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Register ``certs`` and ``etcd-user``; ``add_store_flags`` adds --etcd, --job-id and the
    security flags (elastic-run's own, shared with join, scale, status and keys)."""
    made = commands.add_parser(
        "certs",
        parents=list(parents),
        help="create a CA, an etcd server certificate and client certificates",
        description=_CERTS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    made.add_argument("dir", metavar="DIR", help="where the files go (created if missing)")
    made.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name or IP address clients reach etcd at (repeatable; loopback is always in)",
    )
    made.add_argument(
        "--namespace",
        metavar="NS",
        help="also the names of the namespace's etcd on Kubernetes (k8s/, --with-etcd)",
    )
    made.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="NAME",
        help="a client certificate NAME.crt/NAME.key (repeatable: root, one per job)",
    )
    made.add_argument(
        "--days", type=int, default=certs.DEFAULT_DAYS, metavar="N", help="validity (default 365)"
    )

    user = commands.add_parser(
        "etcd-user",
        parents=list(parents),
        help="give a job an etcd user that may use only the job's keys (run as etcd's root)",
        description=_ETCD_USER_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_store_flags(user)
    user.add_argument(
        "--job-user", metavar="NAME", help="the job's etcd user (default: the job id)"
    )
    user.add_argument(
        "--job-password-file",
        required=True,
        metavar="FILE",
        help="the job user's password (first line); created with a random one if missing",
    )
    user.add_argument(
        "--enable-auth",
        action="store_true",
        help="turn etcd's auth on first if it is off (root's password: --etcd-password-file)",
    )


def run_certs(args: argparse.Namespace) -> int:
    """``elastic-run certs``: write the files and say how to use them."""
    directory = Path(args.dir)
    written = certs.make_certificates(
        directory,
        server_names=args.host,
        namespace=args.namespace,
        clients=args.client,
        days=args.days,
    )
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"elastic-run certs: {directory} has every file asked for; nothing written")
    print(
        f"etcd: --cert-file {directory / certs.SERVER_CERT} --key-file "
        f"{directory / certs.SERVER_KEY} --client-cert-auth --trusted-ca-file "
        f"{directory / certs.CA_CERT}"
    )
    for client in args.client:
        files = certs.client_files(directory, client)
        print(
            f"client {client}: --etcd-cacert {files.cacert} --etcd-cert {files.cert} "
            f"--etcd-key {files.key}"
        )
    return 0


def run_etcd_user(args: argparse.Namespace, store: EtcdStore) -> int:
    """``elastic-run etcd-user``: optionally enable auth, then grant the job its user."""
    job_id = validate_job_id(args.job_id)
    user = args.job_user or job_id
    with store:
        if args.enable_auth and etcd_auth.enable_auth(store):
            print(f"elastic-run etcd-user: auth is now on at {store.describe()} (user root)")
        etcd_auth.require_auth(store)
        password, created = etcd_auth.read_or_create_password(Path(args.job_password_file))
        grant = etcd_auth.grant_job(store, user, password)
    made = "created" if grant.created_user else "updated (new password)"
    print(
        f"elastic-run etcd-user: etcd user {grant.user} {made}; role {grant.role} may read and "
        f"write {grant.prefix} only"
    )
    if created:
        print(f"elastic-run etcd-user: its new password is in {args.job_password_file} (mode 0600)")
    print(
        f"start job {job_id} with --etcd-user {grant.user} --etcd-password-file "
        f"{args.job_password_file}"
    )
    return 0
