"""The ``elastic-run`` command line.

Only what exists is offered: a private etcd server and a look at a job's keys in the store.
Running, joining, scaling and inspecting training jobs arrive with the elastic core.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from elastic_allreduce import __version__, env
from elastic_allreduce.errors import ConfigError, ElasticAllreduceError
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore, parse_endpoints

log = logging.getLogger("elastic-run")

_DESCRIPTION = """\
elastic-run: elastic, fault-tolerant TensorFlow 2 training on Horovod's ring allreduce,
with membership kept in etcd.

This development release ships the membership store and a private etcd server. The training
commands (running a job, join, scale, status) are not implemented yet.
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-run",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"elastic-run {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    etcd = commands.add_parser(
        "etcd",
        help="run a private etcd server on loopback until interrupted",
        description=(
            "Run a private single-member etcd server on a free loopback port (or --port) and "
            "print its endpoint, the value to pass as --etcd. Stops on Ctrl-C or SIGTERM. "
            "Without --data-dir the data lives in a temporary directory removed on exit."
        ),
    )
    etcd.add_argument("--data-dir", help="keep the server's data here (reused on restart)")
    etcd.add_argument("--port", type=int, help="client port (default: a free port)")

    keys = commands.add_parser(
        "keys",
        help="print a job's keys in the store, one JSON object per line",
        description=(
            "Print every key of a job in the membership store with its revision and value, "
            "one JSON object per line (malformed values are shown with the reason)."
        ),
    )
    _add_store_flags(keys)
    keys.add_argument("prefix", nargs="?", default="", help="only keys under this prefix")
    return parser


def _add_store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd",
        default=os.environ.get(env.ETCD_ENDPOINTS),
        metavar="HOST:PORT[,...]",
        help=f"etcd client endpoints (default: ${env.ETCD_ENDPOINTS})",
    )
    parser.add_argument(
        "--job-id",
        default=os.environ.get(env.JOB_ID),
        metavar="NAME",
        help=f"the job's id (default: ${env.JOB_ID})",
    )


def _run_etcd(args: argparse.Namespace) -> int:
    if args.port is not None and not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    server = EmbeddedEtcd(args.data_dir, client_port=args.port, fast=False)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with server:
        print(f"etcd {server.binary} serving on {server.endpoint}; pass --etcd {server.endpoint}")
        sys.stdout.flush()
        while not stop.wait(0.5):
            if server.pid is None:
                print("elastic-run etcd: error: the etcd server exited", file=sys.stderr)
                return 1
    return 0


def _open_store(args: argparse.Namespace) -> EtcdStore:
    if not args.etcd:
        raise ConfigError(f"no etcd endpoint: pass --etcd HOST:PORT or set {env.ETCD_ENDPOINTS}")
    if not args.job_id:
        raise ConfigError(f"no job id: pass --job-id NAME or set {env.JOB_ID}")
    return EtcdStore(parse_endpoints(args.etcd), args.job_id)


def _run_keys(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        snapshot = store.get_prefix(args.prefix)
        for kv in snapshot:
            record: dict[str, object] = {"key": kv.key, "mod_revision": kv.mod_revision}
            if kv.malformed is None:
                record["value"] = kv.value
            else:
                record["malformed"] = kv.malformed
            print(json.dumps(record, sort_keys=True))
        print(f"# {len(snapshot)} keys at revision {snapshot.revision}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``elastic-run``; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "etcd":
            return _run_etcd(args)
        return _run_keys(args)
    except ElasticAllreduceError as exc:
        print(f"elastic-run {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
