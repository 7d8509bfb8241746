"""The ``elastic-run`` command line: run an elastic job locally, and tools around it."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from rich.console import Console

from elastic_allreduce import __version__, env, netinfo
from elastic_allreduce._process import print_stacks_on_sigusr1
from elastic_allreduce.errors import ConfigError, ElasticAllreduceError
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import parse_job, read_job
from elastic_allreduce.records.values import JobConfig, ScaleTarget
from elastic_allreduce.store import EmbeddedEtcd, EtcdSecurity, EtcdStore, parse_endpoints
from elastic_allreduce.store.cache import drain, new_inbox
from launcher import job_options, status_view
from launcher import zoo as zoo_cli
from launcher.exit_codes import EXIT_HANDED_OVER, exit_code
from launcher.k8s import cli as k8s_cli
from launcher.k8s.mode import KubernetesMode
from launcher.k8s.mode import run_job as run_in_kubernetes
from launcher.leader.job import JobResult, Launcher, LaunchSettings
from launcher.node.agent import Agent
from launcher.node.processes import resolve_command
from launcher.observe.observer import (
    JobObserver,
    add_observer_flags,
    observer_settings,
)
from launcher.observe.tensorboard import resolve_directory as resolve_tensorboard_dir
from launcher.observe.timeline import render_file as render_timeline
from launcher.provisioners.local import LocalProvisioner
from launcher.security import cli as security_cli
from launcher.vocabulary import AgentSettings, NodeTemplate

log = logging.getLogger("elastic-run")

_DESCRIPTION = """\
elastic-run: elastic, fault-tolerant TensorFlow 2 training on Horovod's ring allreduce,
with membership kept in etcd.

  elastic-run [OPTIONS] -- python train.py [ARGS]   run a job on this machine
  elastic-run COMMAND ...                           the commands below

Run `elastic-run run --help` for the options of a job. Workers that die are dropped (or
restarted, up to --max-restarts); the others roll back to their last commit and continue.

Exit codes: 0 success; 1 the job failed; 2 bad input (a flag, a file, an unknown job, a
certificate or credential etcd refuses: the message says what to change); 3 an operational
error (etcd or the Kubernetes API unreachable or failing a request: try again, or check it);
4 (`join`) the node left a job that had no launcher for 60 s; 5 the job goes on under another
launcher (`run --kubernetes`: SIGTERM handed it over, the launcher Job's next pod adopts it;
`run --standby`: stopped while it stood by).
"""

_RUN_DESCRIPTION = """\
Run an elastic training job on this machine: a launcher and --workers local worker nodes,
each running --nproc-per-node copies of COMMAND (a Python script using Horovod's elastic API or
elastic_allreduce). Without --etcd a private etcd is started and removed afterwards, and the
nodes stop with the launcher; with --etcd they outlive it (a SIGKILLed launcher leaves them
training), and the same command run again adopts the job and its nodes. The exit
code is the job's: 0 when training finished on every rank, 1 when it failed, 2 for bad input
(etcd refusing a certificate or credential included), 3 when etcd (or the Kubernetes API)
could not be reached or failed a request, 5 when a --standby was stopped while it stood by.
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-run",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"elastic-run {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log debug messages")

    run = commands.add_parser(
        "run",
        parents=[common],
        help="run a job locally (the default: `elastic-run [OPTIONS] -- COMMAND`)",
        description=_RUN_DESCRIPTION,
    )
    _add_local_job_flags(run)
    run.add_argument(
        "--standby",
        action="store_true",
        help="stand by as the job's next launcher: wait while another launcher leads it (same "
        "--etcd and --job-id), take the running job over when that one is gone (no restart, "
        "no rollback), and exit with the job's result; needs --etcd",
    )
    kube = run.add_argument_group(
        "Kubernetes mode",
        "the launcher runs in a pod and starts each worker node as a pod of --worker-template; "
        f"it reads its pod from ${env.POD_NAME}, ${env.POD_UID} and ${env.POD_IP}",
    )
    kube.add_argument(
        "--kubernetes", action="store_true", help="start worker nodes as Kubernetes pods"
    )
    kube.add_argument(
        "--worker-template",
        metavar="FILE",
        help="Pod manifest (YAML/JSON) of a worker; its first container runs `elastic-run join`",
    )
    kube.add_argument(
        "--namespace",
        metavar="NS",
        help=f"namespace of the worker pods (default: ${env.NAMESPACE}, else default)",
    )
    kube.add_argument(
        "--kube-api",
        metavar="URL",
        help=f"Kubernetes API URL (default: ${env.KUBE_API}, else in-cluster or kubeconfig)",
    )
    job_options.add_command(run)

    etcd = commands.add_parser(
        "etcd",
        parents=[common],
        help="run a private etcd server (on loopback, or --host) until interrupted",
        description=(
            "Run a private single-member etcd server on a free port (or --port) of loopback "
            "(or --host) and print its endpoint, the value to pass as --etcd. Stops on Ctrl-C "
            "or SIGTERM. Without --data-dir the data lives in a temporary directory removed on "
            "exit."
        ),
    )
    etcd.add_argument("--data-dir", help="keep the server's data here (reused on restart)")
    etcd.add_argument("--port", type=int, help="client port (default: a free port)")
    etcd.add_argument(
        "--host",
        metavar="ADDRESS",
        help="listen on this address of this machine, IPv4 or IPv6, so that other hosts can "
        "use the server (default: 127.0.0.1)",
    )

    join = commands.add_parser(
        "join",
        parents=[common],
        help="add this machine as one more worker node of a running job",
        description=(
            "Run one worker node for a running job in the foreground: it registers in etcd, "
            "starts --nproc-per-node training processes (default: the job's), and the job "
            "grows at the workers' next commit. Ctrl-C or SIGTERM leaves gracefully."
        ),
    )
    _add_store_flags(join)
    join.add_argument(
        "--nproc-per-node", type=int, metavar="K", help="processes (default: the job's)"
    )
    join.add_argument(
        "--node-id",
        default=os.environ.get(env.NODE_ID),
        metavar="NAME",
        help=f"this node's id (default: ${env.NODE_ID}, else a new one)",
    )
    join.add_argument(
        "--host",
        default=os.environ.get(env.HOST),
        metavar="ADDRESS",
        help=f"the address peers reach this node at, one of this machine's (default: ${env.HOST}, "
        "else the address this machine reaches etcd from)",
    )
    join.add_argument(
        "--gloo-iface",
        default=os.environ.get(env.GLOO_IFACE),
        metavar="NAME",
        help=f"network interface for Gloo (default: ${env.GLOO_IFACE}, else the interface that "
        "holds --host)",
    )
    join.add_argument(
        "command_args",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND [ARGS...]",
        help="the training command this node runs (default: the one the job's launcher stored "
        "in etcd; given here, nobody who can write the job's keys can change what this node "
        "runs, as in the Kubernetes worker pods)",
    )

    scale = commands.add_parser(
        "scale",
        parents=[common],
        help="ask a running job to grow or shrink to N worker nodes",
        description=(
            "Set the number of worker nodes a running job should have. The launcher starts new "
            "nodes or stops the newest ones gracefully, within --min-workers and --max-workers."
        ),
    )
    _add_store_flags(scale)
    scale.add_argument("workers", type=int, metavar="N", help="the number of worker nodes")

    status = commands.add_parser(
        "status",
        parents=[common],
        help="show a job's phase, ring epoch, ranks and members (--watch: live)",
        description=(
            "Show a job's phase, ring epoch, each rank's last step (and how long ago, and its "
            "step time), members, the last commit, the last hang, and the recent events when "
            "the launcher's dashboard answers."
        ),
    )
    _add_store_flags(status)
    shown = status.add_mutually_exclusive_group()
    shown.add_argument(
        "--watch",
        action="store_true",
        help="a live view in the terminal, redrawn as the job changes, until it ends (Ctrl-C "
        "leaves): ring, ranks, steps, a progress bar with ETA when the script declares its "
        "total steps (ea.report_step(step, total=N)), recent events",
    )
    shown.add_argument("--json", action="store_true", help="one JSON object, for scripts")

    keys = commands.add_parser(
        "keys",
        parents=[common],
        help="print a job's keys in the store, one JSON object per line",
        description=(
            "Print every key of a job in the membership store with its revision and value, "
            "one JSON object per line (malformed values are shown with the reason)."
        ),
    )
    _add_store_flags(keys)
    keys.add_argument("prefix", nargs="?", default="", help="only keys under this prefix")
    timeline = commands.add_parser(
        "timeline",
        parents=[common],
        help="draw a job's events file as one picture (ranks over time, faults, steps/s)",
        description=(
            "Draw the events file of a job (`elastic-run run --events-file`, by default "
            "$TMPDIR/elastic-run/<job-id>.events.jsonl) as a PNG: which slot held which rank in "
            "each ring epoch, the crashes, leaves and joins, and the committed steps per second."
        ),
    )
    timeline.add_argument("events_file", metavar="EVENTS", help="the job's events file")
    timeline.add_argument(
        "-o", "--output", default="timeline.png", metavar="PNG", help="default: timeline.png"
    )
    security_cli.add_parsers(commands, [common], _add_store_flags)
    zoo_cli.add_parsers(commands, [common], _add_local_job_flags)
    k8s_cli.add_parser(commands, [common])
    return parser


def _add_local_job_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a job started from here: where its etcd is, etcd's TLS and auth, the job
    flags and the observer's (`elastic-run run` and `elastic-run train`)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--standalone", action="store_true", help="start a private etcd for this job (the default)"
    )
    where.add_argument(
        "--etcd",
        metavar="HOST:PORT[,...]",
        help="use this etcd instead (https://HOST:PORT for TLS: see the etcd TLS and auth flags)",
    )
    parser.add_argument(
        "--host",
        metavar="ADDRESS",
        help="the address of this machine, IPv4 or IPv6, that other hosts reach the launcher "
        "(and, without --etcd, its private etcd) at; then nodes on other hosts can "
        "`elastic-run join` the job (default: 127.0.0.1, this machine only; not for "
        "--kubernetes)",
    )
    security_cli.add_security_flags(parser)
    job_options.add_job_flags(parser)
    add_observer_flags(parser)
    parser.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help="write TensorBoard summaries here: rank 0 of the ring writes DIR/train (per step "
        "the loss and other metrics the script reports, learning rate, samples/s, ring size; a "
        "marker at each membership change), the launcher DIR/launcher (each re-formed ring's "
        "duration by cause); nodes on other hosts need the same path",
    )


def _add_store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd",
        default=os.environ.get(env.ETCD_ENDPOINTS),
        metavar="HOST:PORT[,...]",
        help=f"etcd client endpoints, https://HOST:PORT for TLS (default: ${env.ETCD_ENDPOINTS})",
    )
    parser.add_argument(
        "--job-id",
        default=os.environ.get(env.JOB_ID),
        metavar="NAME",
        help=f"the job's id (default: ${env.JOB_ID})",
    )
    security_cli.add_security_flags(parser)


def _run_etcd(args: argparse.Namespace) -> int:
    if args.port is not None and not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    host = netinfo.check_local_address(args.host) if args.host else "127.0.0.1"
    server = EmbeddedEtcd(args.data_dir, host=host, client_port=args.port, fast=False)
    signals = new_inbox()  # a threading.Event's lock is not safe to take in a handler

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.put(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with server:
        print(f"etcd {server.binary} serving on {server.endpoint}; pass --etcd {server.endpoint}")
        sys.stdout.flush()
        while not drain(signals, timeout=0.5):
            if server.pid is None:
                print("elastic-run etcd: error: the etcd server exited", file=sys.stderr)
                return 1
    return 0


def _open_store(args: argparse.Namespace) -> EtcdStore:
    if not args.etcd:
        raise ConfigError(f"no etcd endpoint: pass --etcd HOST:PORT or set {env.ETCD_ENDPOINTS}")
    if not args.job_id:
        raise ConfigError(f"no job id: pass --job-id NAME or set {env.JOB_ID}")
    return EtcdStore(
        parse_endpoints(args.etcd), args.job_id, security=security_cli.security_from_args(args)
    )


def _run_keys(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        snapshot = store.get_prefix(args.prefix)
        skipped = {s.key: s.reason for s in parse_job(snapshot, snapshot.revision).skipped}
        for kv in snapshot:
            record: dict[str, object] = {"key": kv.key, "mod_revision": kv.mod_revision}
            if kv.malformed is None:
                record["value"] = kv.value
            if kv.key in skipped:
                record["malformed"] = skipped[kv.key]
            print(json.dumps(record, sort_keys=True))
        print(f"# {len(snapshot)} keys at revision {snapshot.revision}", file=sys.stderr)
    return 0


_COMMANDS = (
    "run",
    "join",
    "scale",
    "status",
    "etcd",
    "keys",
    "timeline",
    "certs",
    "etcd-user",
    "train",
    "predict",
    "k8s",
)


def _open_job(args: argparse.Namespace) -> tuple[EtcdStore, JobConfig]:
    """The store of an existing job and its stored configuration (ConfigError if unknown)."""
    store = _open_store(args)
    job = read_job(store)
    if job.config is None:
        store.close()
        broken = [s for s in job.skipped if s.key == keys.JOB_CONFIG]
        why = f" ({broken[0].reason})" if broken else ""
        raise ConfigError(
            f"unknown job {args.job_id!r} at {store.describe()}{why}: check --job-id and --etcd "
            "(`elastic-run keys` lists what is there)"
        )
    return store, job.config.record


def _run_join(args: argparse.Namespace) -> int:
    store, config = _open_job(args)
    store.close()
    nproc = args.nproc_per_node or config.settings.nproc_per_node
    node_id = keys.validate_node_id(args.node_id or f"j{os.getpid()}")
    host, iface = _node_address(args)
    logging.getLogger().setLevel(logging.INFO)
    # The agent and its training processes open their stores from the environment.
    security_cli.export_security(security_cli.security_from_args(args))
    agent = Agent(
        AgentSettings(
            etcd=args.etcd,
            job_id=args.job_id,
            node_id=node_id,
            nproc_per_node=nproc,
            command=_join_command(args, config.command),
            checkpoint_dir=config.checkpoint_dir,
            keep_checkpoints=config.keep_checkpoints,
            workdir=config.workdir,
            tensorboard_dir=config.tensorboard_dir,
            host=host,
            gloo_iface=iface,
            lease_ttl=config.settings.lease_ttl,
            provisioned=os.environ.get(env.PROVISIONED) == "1",
        )
    )
    print(
        f"elastic-run join: node {node_id} joining job {args.job_id} at {host} (Gloo on {iface})",
        flush=True,
    )
    return agent.run()


def _join_command(args: argparse.Namespace, stored: tuple[str, ...]) -> tuple[str, ...]:
    """The command a joining node runs: its own when given (then the stored one is only
    compared with it), else the job's from etcd."""
    given = job_options.training_command(args)
    if not given:
        return stored
    if given != stored:
        log.warning(
            "this node runs the command it was given, %s; the job's config/job says %s",
            shlex.join(given),
            shlex.join(stored),
        )
    return given


def _launcher_host(given: str | None) -> str:
    """The launcher's address for ``run --host`` (checked), or loopback."""
    if not given:
        return "127.0.0.1"
    return netinfo.check_local_address(given)


def _node_address(args: argparse.Namespace) -> tuple[str, str]:
    """The address peers reach this node at and Gloo's interface: as given (checked to be this
    machine's), else the address that routes to etcd and the interface holding it."""
    if args.host:
        host = netinfo.check_local_address(args.host)
    else:
        etcd = parse_endpoints(args.etcd)[0]
        host = netinfo.source_address(etcd.host, etcd.port)
    netinfo.check_host_name(host)
    if args.gloo_iface:
        return host, netinfo.check_interface(args.gloo_iface)
    iface = netinfo.interface_of(host)
    if iface is None:
        raise ConfigError(
            f"no network interface of this machine holds {host}: pass --gloo-iface NAME"
        )
    return host, iface


def _run_scale(args: argparse.Namespace) -> int:
    store, config = _open_job(args)
    with store:
        low, high = config.settings.min_workers, config.settings.max_workers
        if not low <= args.workers <= high:
            raise ConfigError(
                f"cannot scale job {args.job_id!r} to {args.workers} nodes: it was started with "
                f"--min-workers {low} and --max-workers {high}"
            )
        store.put(keys.SCALE_TARGET, ScaleTarget(args.workers).to_json())
    print(f"elastic-run scale: job {args.job_id} asked for {args.workers} nodes")
    return 0


def _run_status(args: argparse.Namespace) -> int:
    store, _ = _open_job(args)
    with store:
        if args.watch:
            with contextlib.suppress(KeyboardInterrupt):
                status_view.watch(store, args.job_id, Console(), until=lambda: False)
            return 0
        view = status_view.gather(store, args.job_id)
    if args.json:
        print(json.dumps(status_view.to_json(view)))
        return 0
    job = view.job
    status = job.status.record if job.status else None
    phase = status.to_json() if status else None
    print(f"job {args.job_id}: {json.dumps(phase)}")
    if job.ring is not None:
        ring = job.ring.record
        print(f"ring epoch {ring.epoch} ({ring.state.value}, cause {ring.cause.value})")
        for rank, slot in enumerate(ring.slots):
            shown = status_view.rank_progress(view.ranks.get(slot), view.now)
            print(f"  rank {rank}: {slot}" + (f" -- {shown}" if shown else ""))
    print(f"members: {', '.join(sorted(job.members)) or '(none)'}")
    progress = job.progress.record.to_json() if job.progress else None
    print(f"last commit: {json.dumps(progress)}")
    if job.hang is not None:
        hang = job.hang.record
        when = time.strftime("%H:%M:%S", time.localtime(hang.at))
        print(f"last hang (at {when}): {hang.describe()}")
        for hung in hang.ranks:
            if hung.answered and hung.collective is None:
                print(f"  stacks of rank {hung.rank} (slot {hung.slot}):")
                print(textwrap.indent(hung.stacks.rstrip(), "    "))
    for skipped in job.skipped:
        print(f"skipped key {skipped.key}: {skipped.reason}")
    if view.dashboard is not None:
        print(f"dashboard: http://{view.dashboard}/")
        if view.events_error is not None:
            print(f"  (not reachable from here: {view.events_error})")
        for event in view.events:
            print(f"  {event.kind.value} (epoch {event.epoch}): {event.message}")
    return 0


def _run_timeline(args: argparse.Namespace) -> int:
    picture, skipped = render_timeline(Path(args.events_file), Path(args.output))
    for reason in skipped:
        print(f"elastic-run timeline: skipped {reason}", file=sys.stderr)
    print(
        f"elastic-run timeline: {len(picture.epochs)} ring epochs, {len(picture.marks)} joins, "
        f"leaves and crashes -> {args.output}"
    )
    return 0


def _refuse_security_flags(args: argparse.Namespace) -> None:
    given = security_cli.given_security_flags(args)
    if given:
        raise ConfigError(
            f"{', '.join(given)} without --etcd: the private etcd of --standalone is plain HTTP "
            "on loopback; pass --etcd https://HOST:PORT for an etcd with TLS"
        )


def _tensorboard_checked(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``--tensorboard-dir`` checked (absolute and created) before `train`'s slow
    definition check."""
    args.tensorboard_dir = resolve_tensorboard_dir(args.tensorboard_dir)
    return args


def _standby(args: argparse.Namespace) -> bool:
    """Whether `run --standby` was asked for (with the --etcd it needs); `train` has none."""
    standby = bool(getattr(args, "standby", False))
    if standby and not args.etcd:
        raise ConfigError(
            "--standby needs the leader's etcd: pass --etcd HOST:PORT (a private etcd dies "
            "with the launcher that started it)"
        )
    return standby


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _interrupt_on_sigterm_and_sigint() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread (the launcher records
    the interrupt, a standby leaves). SIGINT explicitly too: a process started in the
    background by a script inherits it ignored, and Python then installs no handler (a standby
    told `kill -INT` went on standing by; seen in make test run from a background shell)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def _run_job(args: argparse.Namespace) -> int:
    """`elastic-run run`: lead one job, locally or (--kubernetes) with worker pods; the job's
    flags are those of launcher/job_options.py, shared with `elastic-run k8s render|submit`."""
    options, standby = job_options.from_args(args), _standby(args)
    kube_mode = None
    if args.kubernetes:
        # `-- train --model-def ...` (a hand-written launcher pod): the runner's command, as
        # `k8s render` writes it; the definition and data are the pods'.
        options = zoo_cli.in_cluster(options)
    command, job_id = options.command, options.job_id
    if args.kubernetes:
        # The script lives in the workers' image; this pod need not have it.
        kube_mode = KubernetesMode.from_environment(
            args.worker_template, args.namespace, args.kube_api, options.gpus_per_node or None
        )
        args.etcd = args.etcd or os.environ.get(env.ETCD_ENDPOINTS)
        if not args.etcd:
            raise ConfigError(
                "--kubernetes needs an etcd that worker pods can reach: pass --etcd HOST:PORT "
                f"or set {env.ETCD_ENDPOINTS} (k8s/ deploys one)"
            )
        if args.host:
            raise ConfigError(
                "--host is for jobs started here: with --kubernetes, worker pods reach the "
                f"launcher at its pod IP (${env.POD_IP})"
            )
        host, workdir = "127.0.0.1", None
    else:
        host = _launcher_host(args.host)
        command, workdir = resolve_command(command), os.getcwd()
    logging.getLogger().setLevel(logging.INFO)
    settings = job_options.job_settings(options)
    observing = observer_settings(args, job_id)
    tensorboard_dir = resolve_tensorboard_dir(args.tensorboard_dir)

    _interrupt_on_sigterm_and_sigint()
    with contextlib.ExitStack() as stack:
        etcd = args.etcd
        if etcd is None:
            _refuse_security_flags(args)
            security_cli.export_security(EtcdSecurity())  # zero configuration: loopback, plain
            server = stack.enter_context(EmbeddedEtcd(host=host, fast=False))
            etcd = server.endpoints_text
        else:
            # The launcher, its agents and their training processes read it from the environment.
            security = security_cli.security_from_args(args)
            security_cli.export_security(security)
            EtcdStore(etcd, job_id, security=security).check()
        print(f"elastic-run: job {job_id} on etcd {etcd}", flush=True)
        if not netinfo.is_loopback(host):
            print(
                f"elastic-run: other hosts join with: elastic-run join --etcd {etcd} "
                f"--job-id {job_id}",
                flush=True,
            )
        template = NodeTemplate(
            etcd=etcd,
            job_id=job_id,
            nproc_per_node=options.nproc_per_node,
            command=command,
            checkpoint_dir=(
                os.path.abspath(options.checkpoint_dir) if options.checkpoint_dir else None
            ),
            keep_checkpoints=options.keep_checkpoints,
            workdir=workdir,
            tensorboard_dir=tensorboard_dir,
            host=host,
            gloo_iface=netinfo.interface_of(host) or "lo",
            lease_ttl=settings.lease_ttl,
        )
        observer = JobObserver(job_id, settings, observing)
        print(f"elastic-run: events in {observing.events_file}", flush=True)
        if tensorboard_dir is not None:
            print(f"elastic-run: TensorBoard summaries in {tensorboard_dir}", flush=True)
        if kube_mode is not None:
            launch = LaunchSettings(options.workers, settings, template, kube_mode.pod_ip)
            result = run_in_kubernetes(launch, kube_mode, observer)
        else:
            launch = LaunchSettings(options.workers, settings, template, host)
            # Nodes outlive a launcher whose etcd does (the next launcher adopts them).
            provisioner = LocalProvisioner(template, outlive_launcher=args.etcd is not None)
            result = Launcher(launch, provisioner, observer=observer, standby=standby).run()
    return _report(job_id, result)


def _report(job_id: str, result: JobResult) -> int:
    """Say how the job ended (or that it was handed over); the command's exit code."""
    if result.standing_by:
        print(f"elastic-run: stood by for job {job_id}: {result.reason}", flush=True)
        return EXIT_HANDED_OVER
    if result.handed_over:
        print(f"elastic-run: handed job {job_id} over: {result.reason}", flush=True)
        return EXIT_HANDED_OVER
    outcome = "succeeded" if result.succeeded else "failed"
    print(f"elastic-run: job {job_id} {outcome}: {result.reason}", flush=True)
    return 0 if result.succeeded else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``elastic-run``; returns the process exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if (
        arguments
        and arguments[0] not in _COMMANDS
        and arguments[0] not in ("-h", "--help", "--version")
    ):
        arguments = ["run", *arguments]
    args = _build_parser().parse_args(arguments)
    print_stacks_on_sigusr1()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "etcd":
            return _run_etcd(args)
        handlers = {
            "run": _run_job,
            "join": _run_join,
            "scale": _run_scale,
            "status": _run_status,
            "keys": _run_keys,
            "timeline": _run_timeline,
            "certs": security_cli.run_certs,
            "etcd-user": lambda args: security_cli.run_etcd_user(args, _open_store(args)),
            "train": lambda args: zoo_cli.run_train(_tensorboard_checked(args), _run_job),
            "predict": zoo_cli.run_predict,
            "k8s": k8s_cli.run,
        }
        return handlers[args.command](args)
    except ElasticAllreduceError as exc:
        print(f"elastic-run {args.command}: error: {exc}", file=sys.stderr)
        return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
