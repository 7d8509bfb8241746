"""The options of one elastic job, defined once for every command that starts a job.

``elastic-run run`` (locally or with ``--kubernetes``) and ``elastic-run k8s render|submit``
take the same job flags, with the same names, defaults, help and checks, from here:

- :func:`add_job_flags` adds them to a parser (one argument group, "job options"), and
  :func:`add_command` the training command after ``--``;
- :func:`from_args` reads them back as a :class:`JobOptions` (defaults resolved), and
  :func:`validate` checks one, raising a ConfigError that names the flag and the values;
- :func:`job_settings` gives the launcher's :class:`JobSettings`;
- :func:`to_args` writes the flags that parse back to the same options: the launcher Job's
  ``elastic-run run --kubernetes`` command line is made with it.
"""

from __future__ import annotations

import argparse
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.records.keys import validate_job_id
from elastic_allreduce.records.values import (
    DEFAULT_KEEP_CHECKPOINTS,
    JobSettings,
    OnStateLoss,
    StragglerPolicy,
)

DEFAULT_WORKERS: Final = 2
DEFAULT_MIN_WORKERS: Final = 1
DEFAULT_GPUS_PER_NODE: Final = 0
DEFAULT_MAX_RESTARTS: Final = 3
DEFAULT_WAIT_TIMEOUT: Final = 60.0
DEFAULT_START_GRACE: Final = 10.0
DEFAULT_HANG_TIMEOUT: Final = 300.0
#: The shortest --hang-timeout: longer than the default lease TTL and stuck timeout, so that
#: dead, stopped and stuck processes are handled by those first.
MIN_HANG_TIMEOUT: Final = 10.0
DEFAULT_LEASE_TTL: Final = 3
DEFAULT_STUCK_TIMEOUT: Final = 5.0
DEFAULT_RESIZE_TIMEOUT: Final = 60.0
DEFAULT_OUTAGE_TIMEOUT: Final = 300.0
DEFAULT_ON_STATE_LOSS: Final = OnStateLoss.RESTART_FROM_CHECKPOINT
DEFAULT_STRAGGLER_FACTOR: Final = 2.0

#: Title of the argument group of the job flags in every command's --help.
GROUP_TITLE: Final = "job options"


@dataclass(frozen=True)
class JobOptions:
    """What the user asked of one job, every default resolved (see the flags' help)."""

    #: The training command every training process runs (a Python script and its arguments).
    command: tuple[str, ...]
    job_id: str
    workers: int
    min_workers: int
    max_workers: int
    nproc_per_node: int
    #: GPUs per worker node; 0: none asked for (on Kubernetes: as the worker template says).
    gpus_per_node: int
    max_restarts: int
    wait_timeout: float
    checkpoint_dir: str | None
    #: Seconds the first ring epoch waits for every initial worker before it starts with
    #: --min-workers or more.
    start_grace: float = DEFAULT_START_GRACE
    #: Seconds without progress before the hang watchdog acts; 0: no watchdog.
    hang_timeout: float = DEFAULT_HANG_TIMEOUT
    #: TTL of every lease (nodes, training processes, the launcher), in whole seconds.
    lease_ttl: int = DEFAULT_LEASE_TTL
    #: Seconds a member of a failed epoch may stay silent before it is killed and replaced.
    stuck_timeout: float = DEFAULT_STUCK_TIMEOUT
    #: Seconds the members of a resize epoch have to reach their next commit.
    resize_timeout: float = DEFAULT_RESIZE_TIMEOUT
    #: Seconds the control plane waits out an unreachable etcd before the job fails.
    outage_timeout: float = DEFAULT_OUTAGE_TIMEOUT
    #: Checkpoints kept in the job's checkpoint folder (at least 1).
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    #: What the job does when no holder of the newest commit survived.
    on_state_loss: OnStateLoss = DEFAULT_ON_STATE_LOSS
    #: A rank slower than this many times the others is reported (0: not watched).
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR
    #: What is done with a straggler.
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT
    #: A process that starts once the job has trained runs its script up to its elastic run
    #: at a ring of one before it asks to join (--warm-join, the default; --no-warm-join).
    warm_join: bool = True


def new_job_id() -> str:
    """A fresh job id, for a job started without --job-id."""
    return f"job-{secrets.token_hex(3)}"


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """Add the job flags to ``parser``, as one argument group of its --help."""
    group = parser.add_argument_group(
        GROUP_TITLE,
        "the same for `elastic-run run` (local or --kubernetes) and `elastic-run k8s "
        "render|submit`",
    )
    group.add_argument(
        "--job-id",
        metavar="NAME",
        help="the job's id: 1-40 lowercase letters, digits and '-' (default: a new one)",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        metavar="N",
        help=f"worker nodes to start with (default {DEFAULT_WORKERS}); 0: start none, train "
        "with the nodes that `elastic-run join` the job from other hosts",
    )
    group.add_argument(
        "--min-workers",
        type=int,
        default=DEFAULT_MIN_WORKERS,
        metavar="N",
        help=f"fewest worker nodes to train with (default {DEFAULT_MIN_WORKERS})",
    )
    group.add_argument(
        "--max-workers",
        type=int,
        metavar="N",
        help="most worker nodes (default: --workers, or --min-workers if that is more); a "
        "`join` beyond it is refused",
    )
    group.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="K",
        help="training processes per worker node (default: --gpus-per-node, or 1 without GPUs)",
    )
    group.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_GPUS_PER_NODE,
        metavar="G",
        help="GPUs per worker node, one per training process; on Kubernetes the nvidia.com/gpu "
        "of each worker pod (default 0: none, or as the worker template says)",
    )
    group.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        metavar="N",
        help="restarts of crashed or hung processes and replacements of lost nodes, in all, "
        f"before the job gives up on them (default {DEFAULT_MAX_RESTARTS}). A bug in the "
        "script is not retried: when every rank of a ring (two or more) ends with the same "
        "Python error -- exception type and message, or sys.exit code -- or a restarted "
        "process ends with its predecessor's error before it trained a step (reported a step "
        "or committed), the job fails at once with that error's last lines. A crash the other "
        "ranks do not share (a signal, an error of one rank, a failed collective) is restarted",
    )
    group.add_argument(
        "--wait-timeout",
        type=float,
        default=DEFAULT_WAIT_TIMEOUT,
        metavar="S",
        help="seconds the job may have fewer than --min-workers, counting nodes still "
        "starting, before it fails "
        f"(default {_number(DEFAULT_WAIT_TIMEOUT)})",
    )
    group.add_argument(
        "--start-grace",
        type=float,
        default=DEFAULT_START_GRACE,
        metavar="S",
        help="seconds the first ring waits, once the first worker node is ready, for the other "
        "starting ones (their import of TensorFlow may take seconds longer on a busy machine) "
        "before it starts with those that are, if at least --min-workers; the others join as "
        f"they get ready (default {_number(DEFAULT_START_GRACE)}; 0: start with the first "
        "--min-workers)",
    )
    group.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT,
        metavar="S",
        help="seconds the ring may make no progress (no rank finishing a step or a commit, none "
        "in a marked phase such as an evaluation; ranks in different phases, such as some in "
        "the state sync and one in its start-up, count as no progress) before the hang "
        "watchdog collects every rank's stacks and replaces the ranks that are not waiting in "
        "a collective (all waiting: those apart from rank 0's phase); a second "
        f"hang at the same place fails the job. At least {_number(MIN_HANG_TIMEOUT)}, or 0 for "
        f"no watchdog (default {_number(DEFAULT_HANG_TIMEOUT)})",
    )
    group.add_argument(
        "--lease-ttl",
        type=int,
        default=DEFAULT_LEASE_TTL,
        metavar="S",
        help="TTL of the etcd leases of nodes, training processes and the launcher: a dead or "
        "cut-off one is noticed this many seconds after its last renewal, and a node cut off "
        "from etcd this long stops its training processes (default "
        f"{DEFAULT_LEASE_TTL}; must be below --stuck-timeout)",
    )
    group.add_argument(
        "--stuck-timeout",
        type=float,
        default=DEFAULT_STUCK_TIMEOUT,
        metavar="S",
        help="seconds a rank may stay silent after a failure before it is killed and replaced "
        f"(default {_number(DEFAULT_STUCK_TIMEOUT)}; must be below --resize-timeout)",
    )
    group.add_argument(
        "--resize-timeout",
        type=float,
        default=DEFAULT_RESIZE_TIMEOUT,
        metavar="S",
        help="seconds the ranks of a grown or shrunk ring have to reach their next commit "
        "before it is treated as a failure (default "
        f"{_number(DEFAULT_RESIZE_TIMEOUT)})",
    )
    group.add_argument(
        "--outage-timeout",
        type=float,
        default=DEFAULT_OUTAGE_TIMEOUT,
        metavar="S",
        help="seconds the launcher, agents and training processes wait out an unreachable "
        "etcd (restart, leader election, lost quorum) while training goes on, before the job "
        f"fails (default {_number(DEFAULT_OUTAGE_TIMEOUT)}; must be above --stuck-timeout)",
    )
    group.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where periodic checkpoints of elastic_allreduce.State (and of Horovod's "
        "TensorFlowKerasState) go, under DIR/JOB-ID/, written by the node's agent from the "
        "commit's snapshot (the job resumes from the newest usable one when every worker died; "
        "a failed write, such as a full disk, is skipped with a warning); on Kubernetes an "
        "absolute path that every worker pod mounts",
    )
    group.add_argument(
        "--keep-checkpoints",
        type=int,
        default=DEFAULT_KEEP_CHECKPOINTS,
        metavar="K",
        help="checkpoints kept in the job's folder, newest first: loading falls back to an "
        "older one when the newest is unreadable (default "
        f"{DEFAULT_KEEP_CHECKPOINTS}; at least 1; the folder needs room for K+1)",
    )
    group.add_argument(
        "--on-state-loss",
        choices=[choice.value for choice in OnStateLoss],
        default=DEFAULT_ON_STATE_LOSS.value,
        help="when every process holding the newest commit died at once and the ring "
        "restarted from an older one (a checkpoint, else the start): log it and record an "
        "event naming the steps lost, then train on (restart-from-checkpoint, the default), "
        "or also fail the job (fail); judged for elastic_allreduce.State scripts",
    )
    group.add_argument(
        "--straggler-factor",
        type=float,
        default=DEFAULT_STRAGGLER_FACTOR,
        metavar="F",
        help="report a rank whose own share of each step (its step time minus its wait in the "
        "gradient allreduce) stays above F times the other ranks' for 10 reports: a log line "
        f"and a Straggler event (default {_number(DEFAULT_STRAGGLER_FACTOR)}; 0: not watched; "
        "measured where the gradients go through a DistributedGradientTape or "
        "DistributedOptimizer, Horovod's or elastic_allreduce's, and steps are reported)",
    )
    group.add_argument(
        "--straggler-policy",
        choices=[choice.value for choice in StragglerPolicy],
        default=StragglerPolicy.REPORT.value,
        help="what is done with a straggler: report it (the default), or also evict it -- "
        "stop its node and start another in its place, when the ring would step faster "
        "without it and keeps --min-workers meanwhile (nodes the launcher started only)",
    )
    group.add_argument(
        "--warm-join",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a training process that starts once the job has trained (a restart, a "
        "replacement, a node that joins) runs its script up to its elastic run (ea.run or "
        "hvd.elastic.run) -- and the step given to elastic_allreduce.warm_up -- at a ring of "
        "one: rank 0 of size 1, its collectives local; only then does it ask to join. The "
        "ranks in the ring train on meanwhile, and the script's code before its elastic run "
        "(warm-up steps, broadcasts of its own) never meets their state sync. The default; "
        "--no-warm-join admits a newcomer before its script starts, so that its code before "
        "the elastic run sees its rank in the ring, and must do no collectives "
        "(docs/architecture.md#warm-joiners)",
    )


def add_command(parser: argparse.ArgumentParser) -> None:
    """Add the training command (everything after ``--``); add it after every flag."""
    parser.add_argument(
        "command_args",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND [ARGS...]",
        help="the training command every training process runs",
    )


def training_command(args: argparse.Namespace) -> tuple[str, ...]:
    """The training command of parsed arguments, without the ``--`` before it."""
    command = list(args.command_args)
    if command[:1] == ["--"]:
        command = command[1:]
    return tuple(command)


def job_options(
    command: Sequence[str],
    *,
    job_id: str | None = None,
    workers: int = DEFAULT_WORKERS,
    min_workers: int = DEFAULT_MIN_WORKERS,
    max_workers: int | None = None,
    nproc_per_node: int | None = None,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    checkpoint_dir: str | None = None,
    start_grace: float = DEFAULT_START_GRACE,
    hang_timeout: float = DEFAULT_HANG_TIMEOUT,
    lease_ttl: int = DEFAULT_LEASE_TTL,
    stuck_timeout: float = DEFAULT_STUCK_TIMEOUT,
    resize_timeout: float = DEFAULT_RESIZE_TIMEOUT,
    outage_timeout: float = DEFAULT_OUTAGE_TIMEOUT,
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS,
    on_state_loss: OnStateLoss | str = DEFAULT_ON_STATE_LOSS,
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
    straggler_policy: StragglerPolicy | str = StragglerPolicy.REPORT,
    warm_join: bool = True,
) -> JobOptions:
    """The validated options, with the flags' defaults for what is not given."""
    return validate(
        JobOptions(
            command=tuple(command),
            job_id=new_job_id() if job_id is None else job_id,
            workers=workers,
            min_workers=min_workers,
            max_workers=max(workers, min_workers) if max_workers is None else max_workers,
            nproc_per_node=max(1, gpus_per_node) if nproc_per_node is None else nproc_per_node,
            gpus_per_node=gpus_per_node,
            max_restarts=max_restarts,
            wait_timeout=float(wait_timeout),
            checkpoint_dir=checkpoint_dir,
            start_grace=float(start_grace),
            hang_timeout=float(hang_timeout),
            lease_ttl=lease_ttl,
            stuck_timeout=float(stuck_timeout),
            resize_timeout=float(resize_timeout),
            outage_timeout=float(outage_timeout),
            keep_checkpoints=keep_checkpoints,
            on_state_loss=_choice(OnStateLoss, on_state_loss, "--on-state-loss"),
            straggler_factor=float(straggler_factor),
            straggler_policy=_choice(StragglerPolicy, straggler_policy, "--straggler-policy"),
            warm_join=bool(warm_join),
        )
    )


_E = TypeVar("_E", OnStateLoss, StragglerPolicy)


def _choice(kind: type[_E], value: _E | str, flag: str) -> _E:
    """``value`` as one of ``kind``'s choices; a ConfigError naming ``flag`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = " or ".join(choice.value for choice in kind)
        raise ConfigError(f"{flag} must be {choices}, got {value!r}") from None


def from_args(args: argparse.Namespace) -> JobOptions:
    """The options parsed by a parser that :func:`add_job_flags` and :func:`add_command` built
    (validated: ConfigError names the flag)."""
    return job_options(
        training_command(args),
        job_id=args.job_id,
        workers=args.workers,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        nproc_per_node=args.nproc_per_node,
        gpus_per_node=args.gpus_per_node,
        max_restarts=args.max_restarts,
        wait_timeout=args.wait_timeout,
        checkpoint_dir=args.checkpoint_dir,
        start_grace=args.start_grace,
        hang_timeout=args.hang_timeout,
        lease_ttl=args.lease_ttl,
        stuck_timeout=args.stuck_timeout,
        resize_timeout=args.resize_timeout,
        outage_timeout=args.outage_timeout,
        keep_checkpoints=args.keep_checkpoints,
        on_state_loss=args.on_state_loss,
        straggler_factor=args.straggler_factor,
        straggler_policy=args.straggler_policy,
        warm_join=args.warm_join,
    )


def validate(options: JobOptions) -> JobOptions:
    """Return ``options`` if the job can run with them, else raise a ConfigError naming the
    flag, the value given and what is allowed."""
    low, start, high = options.min_workers, options.workers, options.max_workers
    if start < 0 or low < 1:
        raise ConfigError(
            f"--workers ({start}) must be 0 or more and --min-workers ({low}) at least 1"
        )
    if start and not low <= start <= high:
        raise ConfigError(
            f"need --min-workers <= --workers <= --max-workers, got {low} <= {start} <= {high}"
        )
    if not low <= high:
        raise ConfigError(f"need --min-workers <= --max-workers, got {low} <= {high}")
    if options.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 or more, got {options.gpus_per_node}")
    if options.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {options.nproc_per_node}")
    if options.gpus_per_node and options.nproc_per_node > options.gpus_per_node:
        raise ConfigError(
            f"--nproc-per-node {options.nproc_per_node} needs as many GPUs per worker node, but "
            f"--gpus-per-node is {options.gpus_per_node}: each training process has a GPU of "
            "its own"
        )
    if options.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    if not (math.isfinite(options.wait_timeout) and options.wait_timeout > 0):
        raise ConfigError(
            f"--wait-timeout must be a positive number of seconds, got {options.wait_timeout}"
        )
    if not (math.isfinite(options.start_grace) and options.start_grace >= 0):
        raise ConfigError(
            f"--start-grace must be 0 or more seconds, got {_number(options.start_grace)}"
        )
    _validate_timeouts(options)
    _validate_straggler_factor(options.straggler_factor)
    if options.checkpoint_dir is not None and not options.checkpoint_dir.strip():
        raise ConfigError("--checkpoint-dir is empty: give a directory, or leave the flag out")
    if options.keep_checkpoints < 1:
        raise ConfigError(
            f"--keep-checkpoints must be at least 1, got {options.keep_checkpoints}: the job "
            "keeps the newest K checkpoints"
        )
    if not options.command:
        raise ConfigError("no training command: give it after `--`, e.g. `-- python train.py`")
    validate_job_id(options.job_id)
    return options


def _validate_straggler_factor(factor: float) -> None:
    if not (math.isfinite(factor) and (factor == 0 or factor > 1)):
        raise ConfigError(
            f"--straggler-factor must be 0 (not watched) or above 1, got {_number(factor)}: a "
            "rank is a straggler when its share of a step is that many times the others'"
        )


def _validate_timeouts(options: JobOptions) -> None:
    """The timeouts must be in this order: lease TTL < stuck timeout < resize timeout, and the
    hang and outage timeouts (the hang timeout unless 0) above the stuck timeout; each one
    handles what the shorter ones before it could not."""
    ttl, stuck, resize = options.lease_ttl, options.stuck_timeout, options.resize_timeout
    if ttl < 1:
        raise ConfigError(f"--lease-ttl must be at least 1 second, got {ttl}")
    if not (math.isfinite(stuck) and stuck > ttl):
        raise ConfigError(
            f"--stuck-timeout ({_number(stuck)} s) must be longer than --lease-ttl ({ttl} s): "
            "a dead or cut-off node is noticed by its lease before a silent process is called "
            "stuck"
        )
    if not (math.isfinite(resize) and resize > stuck):
        raise ConfigError(
            f"--resize-timeout ({_number(resize)} s) must be longer than --stuck-timeout "
            f"({_number(stuck)} s)"
        )
    outage = options.outage_timeout
    if not (math.isfinite(outage) and outage > stuck):
        raise ConfigError(
            f"--outage-timeout ({_number(outage)} s) must be longer than --stuck-timeout "
            f"({_number(stuck)} s): an etcd outage is waited out, not taken for dead nodes"
        )
    hang = options.hang_timeout
    if not (math.isfinite(hang) and (hang == 0 or hang >= max(MIN_HANG_TIMEOUT, stuck))):
        raise ConfigError(
            f"--hang-timeout must be 0 (no watchdog) or at least "
            f"{_number(max(MIN_HANG_TIMEOUT, stuck))} seconds (and no shorter than the lease "
            f"and stuck-process timeouts), got {_number(hang)}"
        )


def job_settings(options: JobOptions) -> JobSettings:
    """The launcher's settings of the job (stored at ``config/job`` with the command)."""
    return JobSettings(
        min_workers=options.min_workers,
        max_workers=options.max_workers,
        nproc_per_node=options.nproc_per_node,
        max_restarts=options.max_restarts,
        wait_timeout=options.wait_timeout,
        start_grace=options.start_grace,
        hang_timeout=options.hang_timeout,
        lease_ttl=options.lease_ttl,
        stuck_timeout=options.stuck_timeout,
        resize_timeout=options.resize_timeout,
        outage_timeout=options.outage_timeout,
        on_state_loss=options.on_state_loss,
        straggler_factor=options.straggler_factor,
        straggler_policy=options.straggler_policy,
        warm_join=options.warm_join,
    )


def to_args(options: JobOptions) -> list[str]:
    """The job flags and training command that :func:`from_args` reads back as ``options``."""
    args = [
        "--job-id",
        options.job_id,
        "--workers",
        str(options.workers),
        "--min-workers",
        str(options.min_workers),
        "--max-workers",
        str(options.max_workers),
        "--nproc-per-node",
        str(options.nproc_per_node),
    ]
    if options.gpus_per_node:
        args += ["--gpus-per-node", str(options.gpus_per_node)]
    args += [
        "--max-restarts",
        str(options.max_restarts),
        "--wait-timeout",
        _number(options.wait_timeout),
        "--hang-timeout",
        _number(options.hang_timeout),
        "--lease-ttl",
        str(options.lease_ttl),
        "--stuck-timeout",
        _number(options.stuck_timeout),
        "--resize-timeout",
        _number(options.resize_timeout),
        "--outage-timeout",
        _number(options.outage_timeout),
    ]
    if options.start_grace != DEFAULT_START_GRACE:  # the manifests of the default job stay
        args += ["--start-grace", _number(options.start_grace)]
    if options.checkpoint_dir is not None:
        args += ["--checkpoint-dir", options.checkpoint_dir]
    if options.keep_checkpoints != DEFAULT_KEEP_CHECKPOINTS:
        args += ["--keep-checkpoints", str(options.keep_checkpoints)]
    if options.on_state_loss is not DEFAULT_ON_STATE_LOSS:
        args += ["--on-state-loss", options.on_state_loss.value]
    if options.straggler_factor != DEFAULT_STRAGGLER_FACTOR:
        args += ["--straggler-factor", _number(options.straggler_factor)]
    if options.straggler_policy is not StragglerPolicy.REPORT:
        args += ["--straggler-policy", options.straggler_policy.value]
    if not options.warm_join:
        args.append("--no-warm-join")
    return [*args, "--", *options.command]


def _number(value: float) -> str:
    """``value`` as the shortest text that parses back to it (60.0 -> "60")."""
    return str(int(value)) if value.is_integer() else repr(value)
