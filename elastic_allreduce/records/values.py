"""One frozen record type per value stored under a job's prefix (see :mod:`.keys` for where).

Every record has ``to_json()`` (the payload inside the store's envelope, see
:mod:`elastic_allreduce.codec`) and ``from_json(key, value)``, which raises
:class:`~elastic_allreduce.errors.MalformedValueError` naming the key and what is wrong. Values
come from the network: they are parsed field by field, never trusted. Pure: no I/O.
"""

from __future__ import annotations

import enum
import math
import signal as signals
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Final, TypeAlias, TypeVar

from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import MalformedValueError
from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.rendezvous.model import REMOVED, SlotAssignment
from elastic_allreduce.rendezvous.protocol import Endpoint

#: Exit code of a training process that was not admitted to any epoch (not a crash).
NOT_ADMITTED_EXIT_CODE: Final = 75
#: Exit code of a training process whose state could not be synced with its ring's
#: (StateMismatchError: different models on different ranks): the job fails at once, since a
#: restart would meet the same mismatch.
STATE_MISMATCH_EXIT_CODE: Final = 76
#: Checkpoints of ``elastic_allreduce.State`` kept in a job's folder (--keep-checkpoints).
DEFAULT_KEEP_CHECKPOINTS: Final = 2

Scalar: TypeAlias = bool | int | float | str


class JobPhase(str, enum.Enum):
    """The job's phase at ``status/job``."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self is not JobPhase.RUNNING


class ProcPhase(str, enum.Enum):
    """Where a training process is (``procs/<slot>``)."""

    #: Registered; importing TensorFlow and Horovod, then waiting for its first epoch.
    STARTING = "starting"
    #: Admitted to an epoch; the user's script runs.
    TRAINING = "training"
    #: The script ended successfully; the interpreter is shutting down (its agent deletes the
    #: record when it exits).
    FINISHED = "finished"


class EpochCause(str, enum.Enum):
    """Why a ring epoch was formed."""

    #: The job's first epoch.
    START = "start"
    #: A member died or its collective failed: members roll back to their last commit.
    FAILURE = "failure"
    #: A member joined or left gracefully: members reset at their next commit.
    RESIZE = "resize"


class RingState(str, enum.Enum):
    """Whether a ring epoch is waiting for its members or training."""

    #: Decided, but not every member has asked for its rank yet: nobody entered Gloo.
    FORMING = "forming"
    #: Every member received its rank; collectives of this epoch may run.
    RUNNING = "running"


_E = TypeVar("_E", bound=enum.Enum)


class _Fields:
    """Typed reads of one JSON object's fields; every failure is a MalformedValueError."""

    def __init__(self, key: str, value: JsonValue, what: str) -> None:
        if not isinstance(value, dict):
            raise MalformedValueError(key, f"{what} must be a JSON object, got {_short(value)}")
        self.key = key
        self.value = value
        self.what = what

    def _bad(self, name: str, expected: str) -> MalformedValueError:
        got = _short(self.value[name]) if name in self.value else "nothing"
        return MalformedValueError(
            self.key, f"{self.what}: field {name!r} must be {expected}, got {got}"
        )

    def has(self, name: str) -> bool:
        return self.value.get(name) is not None

    def integer(self, name: str, *, minimum: int | None = None) -> int:
        raw = self.value.get(name)
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise self._bad(name, "an integer")
        if minimum is not None and raw < minimum:
            raise self._bad(name, f"an integer >= {minimum}")
        return raw

    def opt_integer(self, name: str, *, minimum: int | None = None) -> int | None:
        return self.integer(name, minimum=minimum) if self.has(name) else None

    def number(self, name: str, default: float) -> float:
        raw = self.value.get(name, default)
        if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw):
            raise self._bad(name, "a finite number")
        return float(raw)

    def opt_number(self, name: str, *, minimum: float) -> float | None:
        if not self.has(name):
            return None
        number = self.number(name, 0.0)
        if number < minimum:
            raise self._bad(name, f"a number >= {minimum:g}")
        return number

    def text(self, name: str) -> str:
        raw = self.value.get(name)
        if not isinstance(raw, str):
            raise self._bad(name, "a string")
        return raw

    def opt_text(self, name: str) -> str | None:
        return self.text(name) if self.has(name) else None

    def flag(self, name: str, default: bool = False) -> bool:
        raw = self.value.get(name, default)
        if not isinstance(raw, bool):
            raise self._bad(name, "true or false")
        return raw

    def strings(self, name: str, *, default: tuple[str, ...] | None = None) -> tuple[str, ...]:
        if name not in self.value and default is not None:
            return default
        raw = self.value.get(name)
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            raise self._bad(name, "a list of strings")
        return tuple(str(item) for item in raw)

    def integers(
        self, name: str, *, minimum: int, default: tuple[int, ...] | None = None
    ) -> tuple[int, ...]:
        if name not in self.value and default is not None:
            return default
        raw = self.value.get(name)
        items = raw if isinstance(raw, list) else [None]
        numbers = tuple(i for i in items if isinstance(i, int) and not isinstance(i, bool))
        if len(numbers) != len(items) or any(n < minimum for n in numbers):
            raise self._bad(name, f"a list of integers >= {minimum}")
        return numbers

    def enum(self, name: str, kind: type[_E], default: _E | None = None) -> _E:
        if name not in self.value and default is not None:
            return default
        raw = self.value.get(name)
        try:
            return kind(raw)
        except ValueError:
            choices = ", ".join(repr(member.value) for member in kind)
            raise self._bad(name, f"one of {choices}") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class LeaderRecord:
    """``launcher/leader``: the leading launcher's rendezvous (None while it starts), the token
    its rendezvous requires (``rendezvous.protocol.TOKEN_HEADER``; new for every launcher) and,
    when it serves one (``--metrics-port``), its dashboard, metrics and JSON API
    (``host:port``)."""

    rendezvous: str | None
    dashboard: str | None = None
    #: A credential: kept out of repr (log lines, tracebacks).
    token: str | None = field(default=None, repr=False)

    def endpoint(self) -> Endpoint | None:
        """The rendezvous with its token, once the launcher serves it."""
        return None if self.rendezvous is None else Endpoint(self.rendezvous, self.token)

    def to_json(self) -> JsonValue:
        return {"rendezvous": self.rendezvous, "dashboard": self.dashboard, "token": self.token}

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> LeaderRecord:
        fields = _Fields(key, value, "the leader record")
        return cls(
            fields.opt_text("rendezvous"), fields.opt_text("dashboard"), fields.opt_text("token")
        )


class StragglerPolicy(str, enum.Enum):
    """What the job does with a straggler (``--straggler-policy``)."""

    #: Log it and record an event.
    REPORT = "report"
    #: Also stop its node and start another in its place, when the ring would step faster
    #: without it.
    EVICT = "evict"


class OnStateLoss(str, enum.Enum):
    """What the job does when a ring lost the newest commit (``--on-state-loss``)."""

    #: Log it, record the event and train on from what the ring has (a checkpoint, else the
    #: start).
    RESTART_FROM_CHECKPOINT = "restart-from-checkpoint"
    #: Fail the job with that reason.
    FAIL = "fail"


@dataclass(frozen=True)
class JobSettings:
    """What the user asked of the ring; part of ``config/job`` so a launcher can read it back."""

    min_workers: int
    max_workers: int
    nproc_per_node: int
    max_restarts: int
    #: Seconds the job may stay below min_workers before it fails.
    wait_timeout: float = 60.0
    #: Seconds the first epoch waits for every initial worker before starting with >= min.
    start_grace: float = 10.0
    #: Seconds a member of a failed epoch may stay silent before it is killed and replaced.
    stuck_timeout: float = 5.0
    #: Seconds members of a resize epoch have to reach their next commit before it is treated
    #: as a failure (their collectives are then interrupted).
    resize_timeout: float = 60.0
    #: Seconds the running ring may make no progress before the hang watchdog acts (0: off).
    hang_timeout: float = 300.0
    #: TTL in seconds of every lease (agents, training processes, the launcher): how long a
    #: dead or cut-off node or process stays a member.
    lease_ttl: int = 3
    #: Seconds the launcher, agents and training processes wait out an unreachable store
    #: before they give up (and the job fails).
    outage_timeout: float = 300.0
    #: When no holder of the newest commit survived a failure.
    on_state_loss: OnStateLoss = OnStateLoss.RESTART_FROM_CHECKPOINT
    #: A rank whose own share of each step stays above this many times the other ranks' is
    #: reported as a straggler (0: not watched); see launcher/leader/stragglers.py.
    straggler_factor: float = 2.0
    #: What is done with a straggler.
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT
    #: A process that starts once the job has trained builds its model and runs the script's
    #: code before its elastic run at a ring of one, and asks to join only then (the default;
    #: ``--no-warm-join`` turns it off; elastic_allreduce/training/warm.py).
    warm_join: bool = True

    def to_json(self) -> dict[str, JsonValue]:
        return {
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "nproc_per_node": self.nproc_per_node,
            "max_restarts": self.max_restarts,
            "wait_timeout": self.wait_timeout,
            "start_grace": self.start_grace,
            "stuck_timeout": self.stuck_timeout,
            "resize_timeout": self.resize_timeout,
            "hang_timeout": self.hang_timeout,
            "lease_ttl": self.lease_ttl,
            "outage_timeout": self.outage_timeout,
            "on_state_loss": self.on_state_loss.value,
            "straggler_factor": self.straggler_factor,
            "straggler_policy": self.straggler_policy.value,
            "warm_join": self.warm_join,
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> JobSettings:
        fields = _Fields(key, value, "the job settings")
        settings = cls(
            min_workers=fields.integer("min_workers", minimum=1),
            max_workers=fields.integer("max_workers", minimum=1),
            nproc_per_node=fields.integer("nproc_per_node", minimum=1),
            max_restarts=fields.integer("max_restarts", minimum=0),
            wait_timeout=fields.number("wait_timeout", 60.0),
            start_grace=fields.number("start_grace", 10.0),
            stuck_timeout=fields.number("stuck_timeout", 5.0),
            resize_timeout=fields.number("resize_timeout", 60.0),
            hang_timeout=fields.number("hang_timeout", 300.0),
            lease_ttl=fields.opt_integer("lease_ttl", minimum=1) or 3,
            outage_timeout=fields.number("outage_timeout", 300.0),
            on_state_loss=fields.enum(
                "on_state_loss", OnStateLoss, OnStateLoss.RESTART_FROM_CHECKPOINT
            ),
            straggler_factor=fields.number("straggler_factor", 2.0),
            straggler_policy=fields.enum(
                "straggler_policy", StragglerPolicy, StragglerPolicy.REPORT
            ),
            warm_join=fields.flag("warm_join", default=True),
        )
        if settings.min_workers > settings.max_workers:
            raise MalformedValueError(
                key,
                f"min_workers {settings.min_workers} is above max_workers {settings.max_workers}",
            )
        return settings


@dataclass(frozen=True)
class JobConfig:
    """``config/job``: the job's settings, its training command, checkpoint directory, the
    working directory its training processes run in (None: the agent's own), the directory
    of its TensorBoard summaries (None: none) and how many checkpoints to keep (a value
    without the field, from an older version, keeps the default)."""

    settings: JobSettings
    command: tuple[str, ...]
    checkpoint_dir: str | None = None
    workdir: str | None = None
    tensorboard_dir: str | None = None
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS

    def to_json(self) -> JsonValue:
        return {
            **self.settings.to_json(),
            "command": list(self.command),
            "checkpoint_dir": self.checkpoint_dir,
            "workdir": self.workdir,
            "tensorboard_dir": self.tensorboard_dir,
            "keep_checkpoints": self.keep_checkpoints,
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> JobConfig:
        fields = _Fields(key, value, "the job configuration")
        command = fields.strings("command")
        if not command:
            raise MalformedValueError(key, "the job configuration has an empty command")
        return cls(
            JobSettings.from_json(key, value),
            command,
            fields.opt_text("checkpoint_dir"),
            fields.opt_text("workdir"),
            fields.opt_text("tensorboard_dir"),
            fields.opt_integer("keep_checkpoints", minimum=1) or DEFAULT_KEEP_CHECKPOINTS,
        )


@dataclass(frozen=True)
class ScaleTarget:
    """``config/target``: the number of worker nodes asked for with ``elastic-run scale``."""

    workers: int

    def to_json(self) -> JsonValue:
        return {"workers": self.workers}

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> ScaleTarget:
        return cls(_Fields(key, value, "the scale target").integer("workers", minimum=0))


@dataclass(frozen=True)
class MemberRecord:
    """``members/<node>``: a live node, under its agent's lease."""

    host: str
    slots: int
    pid: int | None = None
    #: The node is leaving gracefully (SIGTERM to its agent, or a scale-down).
    leaving: bool = False
    #: The TCP port of the agent's probe listener on ``host`` (None: it probes no peer).
    probe: int | None = None
    #: The members this node's agent could not connect to at its last probe of each.
    unreachable: tuple[str, ...] = ()

    def to_json(self) -> JsonValue:
        return {
            "host": self.host,
            "slots": self.slots,
            "pid": self.pid,
            "leaving": self.leaving,
            "probe": self.probe,
            "unreachable": list(self.unreachable),
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> MemberRecord:
        fields = _Fields(key, value, "the member record")
        probe = fields.opt_integer("probe", minimum=1)
        if probe is not None and probe > 65535:
            raise MalformedValueError(key, f"probe port {probe} is not a TCP port")
        return cls(
            fields.text("host"),
            fields.integer("slots", minimum=1),
            fields.opt_integer("pid", minimum=1),
            fields.flag("leaving"),
            probe,
            fields.strings("unreachable", default=()),
        )


@dataclass(frozen=True)
class ProcRecord:
    """``procs/<slot>``: a live training process, under its node's lease (``lease``)."""

    pid: int
    incarnation: int
    phase: ProcPhase
    lease: int | None = None
    #: The first ring epoch it was admitted to (TRAINING and later).
    epoch: int | None = None
    #: A warm joiner's seconds for one step of its warm-up at a ring of one, after the trace
    #: (None: not measured).
    warmup_step: float | None = None

    def to_json(self) -> JsonValue:
        return {
            "pid": self.pid,
            "incarnation": self.incarnation,
            "phase": self.phase.value,
            "lease": self.lease,
            "epoch": self.epoch,
            "warmup_step": self.warmup_step,
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> ProcRecord:
        fields = _Fields(key, value, "the process record")
        return cls(
            fields.integer("pid", minimum=1),
            fields.integer("incarnation", minimum=1),
            fields.enum("phase", ProcPhase),
            fields.opt_integer("lease"),
            fields.opt_integer("epoch", minimum=0),
            fields.opt_number("warmup_step", minimum=0.0),
        )


@dataclass(frozen=True)
class ScriptError:
    """The error a training script ended with (its exception, or ``sys.exit`` with a code),
    as the bootstrap wrote it for the agent: the launcher tells a bug in the script -- every
    rank of a ring failing alike, or a restarted process failing again as its predecessor did
    before it trained a step -- from a crash of one process (:mod:`launcher.leader.policy`).

    ``kind`` is the exception's type (``ValueError``, ``module.Class``), ``message`` its text
    (at most :data:`MAX_ERROR_MESSAGE` characters), ``lines`` the last lines of its traceback;
    ``epoch`` the ring epoch the process was in (0: none yet), ``trained`` whether it had
    reported a step or a commit. A failed collective (a peer died) is never written as one."""

    kind: str
    message: str
    epoch: int = 0
    trained: bool = False
    lines: tuple[str, ...] = ()

    @property
    def signature(self) -> tuple[str, str]:
        """What two errors must share to be the same error: type and message."""
        return self.kind, self.message

    def describe(self) -> str:
        """``ValueError: the message`` (a message of several lines: its first)."""
        first = self.message.splitlines()[0] if self.message else ""
        return f"{self.kind}: {first}" if first else self.kind

    def to_json(self) -> JsonValue:
        return {
            "kind": self.kind,
            "message": self.message,
            "epoch": self.epoch,
            "trained": self.trained,
            "lines": list(self.lines),
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> ScriptError:
        fields = _Fields(key, value, "the script's error")
        kind, message = fields.text("kind"), fields.text("message")
        lines = fields.strings("lines", default=())
        if not kind or len(kind) > MAX_ERROR_KIND or len(message) > MAX_ERROR_MESSAGE:
            raise MalformedValueError(
                key,
                f"the script's error: a type of 1-{MAX_ERROR_KIND} characters and a message of at "
                f"most {MAX_ERROR_MESSAGE} are expected, got {len(kind)} and {len(message)}",
            )
        if len(lines) > MAX_ERROR_LINES or any(len(line) > MAX_ERROR_MESSAGE for line in lines):
            raise MalformedValueError(
                key, f"the script's error: at most {MAX_ERROR_LINES} lines are expected"
            )
        return cls(kind, message, fields.integer("epoch", minimum=0), fields.flag("trained"), lines)


#: Limits of a :class:`ScriptError`: its type's name, its message, its traceback's lines.
MAX_ERROR_KIND: Final = 200
MAX_ERROR_MESSAGE: Final = 2000
MAX_ERROR_LINES: Final = 12


@dataclass(frozen=True)
class ExitRecord:
    """``exits/<slot>/<incarnation>``: how a process ended, as its agent saw it; ``error``:
    what the script ended with, when the bootstrap could say (an exception or ``sys.exit``)."""

    code: int | None
    signal: int | None
    tail: tuple[str, ...] = ()
    error: ScriptError | None = None

    @classmethod
    def from_returncode(
        cls, returncode: int, tail: tuple[str, ...] = (), error: ScriptError | None = None
    ) -> ExitRecord:
        """From :attr:`subprocess.Popen.returncode` (negative: killed by that signal)."""
        if returncode < 0:
            return cls(None, -returncode, tail)
        return cls(returncode, None, tail, None if returncode == 0 else error)

    @property
    def succeeded(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        """``exit code 3``, ``killed by SIGKILL`` or ``not admitted``."""
        if self.signal is not None:
            try:
                return f"killed by {signals.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        if self.code == NOT_ADMITTED_EXIT_CODE:
            return "not admitted"
        return f"exit code {self.code}"

    def to_json(self) -> JsonValue:
        return {
            "code": self.code,
            "signal": self.signal,
            "tail": list(self.tail),
            "error": None if self.error is None else self.error.to_json(),
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> ExitRecord:
        fields = _Fields(key, value, "the exit record")
        code, signal = fields.opt_integer("code"), fields.opt_integer("signal", minimum=1)
        if (code is None) == (signal is None):
            raise MalformedValueError(key, "an exit record has either a code or a signal")
        error = ScriptError.from_json(key, fields.value["error"]) if fields.has("error") else None
        return cls(code, signal, fields.strings("tail", default=()), error)


@dataclass(frozen=True)
class Directive:
    """``directives/<node>``: the incarnation each slot of the node must run (absent: stop it).

    ``leader`` is the lease of the launcher that wrote it: an agent follows only its current
    leader's directives (:func:`from_leader`)."""

    incarnations: tuple[tuple[int, int], ...]
    leader: int | None = None

    def get(self, index: int) -> int:
        """The incarnation slot ``index`` must run; 0: none (stop it)."""
        return dict(self.incarnations).get(index, 0)

    def to_json(self) -> JsonValue:
        slots: dict[str, JsonValue] = {str(i): incarnation for i, incarnation in self.incarnations}
        return {"slots": slots, "leader": self.leader}

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> Directive:
        fields = _Fields(key, value, "the directive")
        leader = fields.opt_integer("leader", minimum=1)
        slots = fields.value.get("slots")
        if not isinstance(slots, dict):
            raise MalformedValueError(key, "a directive's 'slots' must be an object")
        pairs = []
        for index, incarnation in slots.items():
            if not index.isdigit() or not isinstance(incarnation, int) or incarnation < 1:
                raise MalformedValueError(
                    key,
                    f"directive entry {index!r}: {_short(incarnation)}: expected a slot index "
                    "and an incarnation >= 1",
                )
            pairs.append((int(index), incarnation))
        return cls(tuple(sorted(pairs)), leader)


@dataclass(frozen=True)
class JobStatus:
    """``status/job``: the job's phase, and why it ended; ``leader``: the lease of the launcher
    that wrote it (agents end only on their leader's word, :func:`from_leader`)."""

    phase: JobPhase
    reason: str | None = None
    leader: int | None = None

    def to_json(self) -> JsonValue:
        return {"phase": self.phase.value, "reason": self.reason, "leader": self.leader}

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> JobStatus:
        fields = _Fields(key, value, "the job status")
        return cls(
            fields.enum("phase", JobPhase),
            fields.opt_text("reason"),
            fields.opt_integer("leader", minimum=1),
        )


def from_leader(stamp: int | None, leader: int | None) -> bool:
    """Whether a record stamped ``stamp`` comes from the launcher whose lease is ``leader`` (the
    leader key's lease, or the last one seen once the key is gone): any other writer of the
    job's keys -- a stale launcher, a process with the job's credentials -- is not obeyed."""
    return stamp is not None and stamp == leader


@dataclass(frozen=True)
class Progress:
    """``status/progress``: the last commit, as rank 0 reported it (the state's scalar
    attributes, such as ``step`` and ``epoch``, and the ring size)."""

    attributes: tuple[tuple[str, Scalar], ...]
    size: int | None = None

    @classmethod
    def of(cls, attributes: Mapping[str, object], size: int | None) -> Progress:
        """The scalar attributes of a state (others are not reported)."""
        kept = sorted(
            (name, value)
            for name, value in attributes.items()
            if isinstance(value, (bool, int, float, str)) and name != "size"
        )
        return cls(tuple(kept), size)

    def get(self, name: str) -> Scalar | None:
        return dict(self.attributes).get(name)

    def to_json(self) -> JsonValue:
        return {**dict(self.attributes), "size": self.size}

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> Progress:
        fields = _Fields(key, value, "the progress record")
        attributes = {
            name: item
            for name, item in fields.value.items()
            if name != "size" and isinstance(item, (bool, int, float, str))
        }
        return cls.of(attributes, fields.opt_integer("size", minimum=1))


@dataclass(frozen=True)
class Ring:
    """``ring``: one ring epoch, written by compare-and-swap.

    Its rank order is the order of ``slots``: survivors keep their relative order and newcomers
    are appended, so rank 0 is always the oldest survivor, whose committed state the others
    receive.
    """

    epoch: int
    slots: tuple[str, ...]
    state: RingState
    rendezvous: str
    #: Slots of a FORMING epoch that have not asked for their rank yet.
    waiting: tuple[str, ...] = field(default=())
    cause: EpochCause = EpochCause.START
    #: Restarts of ``--max-restarts`` spent when the epoch was written: a launcher that takes
    #: the job over goes on from there instead of with a new budget.
    restarts_used: int = 0
    #: Each slot's process incarnation when it became a member (0: not known), in the order
    #: of ``slots``; empty in a ring written before this field. A launcher that takes the job
    #: over tells a member from a later process of its slot by it.
    incarnations: tuple[int, ...] = ()
    #: Some epoch of the job has run (this one or an earlier one): a process that starts now
    #: warms up before it joins (--warm-join); before, it starts with the job's first ring.
    has_run: bool = False

    @property
    def trained(self) -> bool:
        """Whether the job has trained: some epoch ran (also for a ring written before
        ``has_run`` existed, when this one runs)."""
        return self.has_run or self.state is RingState.RUNNING

    def incarnation(self, slot: str) -> int | None:
        """The incarnation ``slot`` had when it became a member; None when not known."""
        if slot not in self.slots or not self.incarnations:
            return None
        return self.incarnations[self.slots.index(slot)] or None

    def assignment(self, slot: str) -> SlotAssignment:
        """The slot's ranks in this epoch; REMOVED when it is not a member."""
        if slot not in self.slots:
            return REMOVED
        rank = self.slots.index(slot)
        size = len(self.slots)
        return SlotAssignment(rank=rank, size=size, cross_rank=rank, cross_size=size)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The member nodes, in rank order of their first slot."""
        seen: dict[str, None] = {}
        for slot in self.slots:
            seen.setdefault(split_slot(slot)[0], None)
        return tuple(seen)

    def to_json(self) -> JsonValue:
        return {
            "epoch": self.epoch,
            "slots": list(self.slots),
            "state": self.state.value,
            "rendezvous": self.rendezvous,
            "waiting": list(self.waiting),
            "cause": self.cause.value,
            "restarts_used": self.restarts_used,
            "incarnations": list(self.incarnations),
            "has_run": self.has_run,
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> Ring:
        fields = _Fields(key, value, "the ring")
        slots = fields.strings("slots")
        waiting = fields.strings("waiting", default=())
        for slot in (*slots, *waiting):
            try:
                split_slot(slot)
            except ValueError as exc:
                raise MalformedValueError(key, f"the ring: {exc}") from None
        if len(set(slots)) != len(slots):
            raise MalformedValueError(key, f"the ring lists a slot twice: {list(slots)}")
        incarnations = fields.integers("incarnations", minimum=0, default=())
        if incarnations and len(incarnations) != len(slots):
            raise MalformedValueError(
                key, f"the ring has {len(incarnations)} incarnations for {len(slots)} slots"
            )
        return cls(
            fields.integer("epoch", minimum=1),
            slots,
            fields.enum("state", RingState),
            fields.text("rendezvous"),
            waiting,
            fields.enum("cause", EpochCause, EpochCause.START),
            fields.opt_integer("restarts_used", minimum=0) or 0,
            incarnations,
            fields.flag("has_run"),
        )


def _items(key: str, value: JsonValue, name: str, what: str) -> list[JsonValue]:
    items = value.get(name) if isinstance(value, dict) else None
    if not isinstance(items, list):
        raise MalformedValueError(key, f"{what}: field {name!r} must be a list")
    return items


def _flat_json(record: RankProgress | HangRank) -> dict[str, JsonValue]:
    """A record whose fields are all JSON scalars, as an object of its fields."""
    return {item.name: getattr(record, item.name) for item in fields(record)}


def _opt_number(fields: _Fields, name: str) -> float | None:
    return fields.number(name, 0.0) if fields.has(name) else None


@dataclass(frozen=True)
class RankProgress:
    """One ring member's progress, as the launcher last heard it from the process."""

    slot: str
    rank: int
    incarnation: int
    #: The script's step (None: the library does not know it).
    step: int | None
    #: Steps and commits counted since the process started (see elastic_allreduce.progress).
    ticks: int
    #: Seconds the last step took.
    step_seconds: float | None
    #: A long phase it is in (``startup``, ``evaluation``, ...), None while it trains.
    phase: str | None
    #: When it last made progress (Unix seconds, the launcher's clock); None: not yet.
    progressed_at: float | None
    #: The steps the script said it will take in all.
    total_steps: int | None = None
    #: Samples its last step took across the ring (the global batch), when the script said.
    samples_per_step: int | None = None
    #: Steps it ran past a commit and lost to failures, in all.
    rolled_back_steps: int = 0

    def to_json(self) -> JsonValue:
        return _flat_json(self)

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> RankProgress:
        fields = _Fields(key, value, "a rank's progress")
        return cls(
            slot=_slot_field(fields, "slot"),
            rank=fields.integer("rank", minimum=0),
            incarnation=fields.integer("incarnation", minimum=1),
            step=fields.opt_integer("step", minimum=0),
            ticks=fields.integer("ticks", minimum=0),
            step_seconds=_opt_number(fields, "step_seconds"),
            phase=fields.opt_text("phase"),
            progressed_at=_opt_number(fields, "progressed_at"),
            total_steps=fields.opt_integer("total_steps", minimum=1),
            samples_per_step=fields.opt_integer("samples_per_step", minimum=1),
            rolled_back_steps=fields.opt_integer("rolled_back_steps", minimum=0) or 0,
        )


def _slot_field(fields: _Fields, name: str) -> str:
    slot = fields.text(name)
    try:
        split_slot(slot)
    except ValueError as exc:
        raise MalformedValueError(fields.key, f"{fields.what}: {exc}") from None
    return slot


@dataclass(frozen=True)
class RanksRecord:
    """``status/ranks``: every member's progress in the running ring epoch, written by the
    launcher when it changed, at most every few seconds (not per step)."""

    epoch: int
    #: When the launcher wrote it (Unix seconds).
    written_at: float
    ranks: tuple[RankProgress, ...]

    def to_json(self) -> JsonValue:
        return {
            "epoch": self.epoch,
            "written_at": self.written_at,
            "ranks": [rank.to_json() for rank in self.ranks],
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> RanksRecord:
        fields = _Fields(key, value, "the ranks' progress")
        items = _items(key, value, "ranks", "the ranks' progress")
        return cls(
            fields.integer("epoch", minimum=1),
            fields.number("written_at", 0.0),
            tuple(RankProgress.from_json(key, item) for item in items),
        )


@dataclass(frozen=True)
class HangRank:
    """Where one rank was when the ring hung."""

    slot: str
    rank: int
    step: int | None
    #: The collective it waited in; None: it was elsewhere (or did not answer).
    collective: str | None
    #: Its innermost frame outside the libraries (``file:line in function``).
    where: str
    #: Every thread's Python stack ("" when it did not answer).
    stacks: str
    answered: bool

    def describe(self) -> str:
        """One line: the rank, its step and where it was."""
        step = "?" if self.step is None else str(self.step)
        head = f"rank {self.rank} (slot {self.slot}, step {step}): "
        if not self.answered:
            return head + "did not answer (stuck outside Python, or its host is unreachable)"
        if self.collective is not None:
            return head + f"waits in a collective: {self.collective}, called at {self.where}"
        return head + f"NOT in a collective, at {self.where}"

    def to_json(self) -> JsonValue:
        return _flat_json(self)

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> HangRank:
        fields = _Fields(key, value, "a hung rank")
        return cls(
            slot=_slot_field(fields, "slot"),
            rank=fields.integer("rank", minimum=0),
            step=fields.opt_integer("step", minimum=0),
            collective=fields.opt_text("collective"),
            where=fields.text("where"),
            stacks=fields.text("stacks"),
            answered=fields.flag("answered"),
        )


@dataclass(frozen=True)
class HangRecord:
    """``status/hang``: the last hang the launcher's watchdog found, with its diagnosis."""

    epoch: int
    #: When it was found (Unix seconds).
    at: float
    #: Seconds the ring had made no progress.
    stalled_for: float
    #: What the launcher did ("replaced slots ...", or why the job failed).
    action: str
    ranks: tuple[HangRank, ...]

    def describe(self) -> str:
        """The diagnosis in a few lines (no stacks)."""
        head = (
            f"ring epoch {self.epoch} made no progress for {self.stalled_for:.0f} s: {self.action}"
        )
        return "\n".join([head, *(f"  {rank.describe()}" for rank in self.ranks)])

    def to_json(self) -> JsonValue:
        return {
            "epoch": self.epoch,
            "at": self.at,
            "stalled_for": self.stalled_for,
            "action": self.action,
            "ranks": [rank.to_json() for rank in self.ranks],
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> HangRecord:
        fields = _Fields(key, value, "the hang diagnosis")
        items = _items(key, value, "ranks", "the hang diagnosis")
        return cls(
            fields.integer("epoch", minimum=1),
            fields.number("at", 0.0),
            fields.number("stalled_for", 0.0),
            fields.text("action"),
            tuple(HangRank.from_json(key, item) for item in items),
        )
