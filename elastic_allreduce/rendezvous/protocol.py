"""The rendezvous protocol between the launcher's HTTP server and the training processes.

The launcher serves Horovod's rendezvous (``launcher/leader/rendezvous.py``) and answers, besides
Gloo's own key-value scopes:

* ``GET /rank_and_size/<slot>:0`` -- Horovod's elastic re-initialisation after a reset. Held
  open until the slot's next epoch starts; the reply is six comma-separated ints (rank, size,
  local rank, local size, cross rank, cross size), all -1 when the slot is not admitted.
* ``GET /elastic_ready/<slot>`` -- the same barrier for a fresh process; the reply is the epoch
  followed by the six ints: ``"<epoch>,<rank>,<size>,..."``.
* ``GET /elastic_epoch/<slot>`` -- the epoch the slot was last admitted to: ``"<epoch>"``.
* ``GET /node_standing/<node>`` -- whether the launcher still counts a node as a member
  (:class:`NodeStanding`): an agent that lost etcd asks before it stops its processes.
* ``PUT /worker_addresses/<slot>:0`` -- a worker's notification service address.
* ``PUT /progress/<slot>`` -- a training process's progress (:class:`ProgressReport`, JSON),
  about once a second; the reply (:class:`ProgressReply`) may ask for its stacks.
* ``PUT /stacks/<slot>`` -- the process's Python stacks (:class:`StacksReport`, JSON), sent
  when a reply asked for them (the launcher's hang watchdog).

Every request carries the launcher's token in :data:`TOKEN_HEADER` (:func:`authorized`); the
launcher makes a new one when it starts leading and publishes it in ``launcher/leader`` next to
its address, so only what can read the job's keys can use the rendezvous. Horovod's own
clients, which send no such header, reach the launcher through a relay in the training process
that adds it (:mod:`elastic_allreduce.rendezvous.relay`).

This module owns the scope names, the request keys, the reply encodings and the URLs (with
brackets for IPv6 addresses); the server and the clients both use it. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hmac
import io
import ipaddress
import json
import math
import pickle
import secrets
from dataclasses import dataclass, field
from typing import Final, NoReturn

from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous.model import REMOVED, SlotAssignment

RANK_AND_SIZE: Final = "rank_and_size"
ELASTIC_READY: Final = "elastic_ready"
#: The barrier of a warm joiner (``--warm-join``): as ``elastic_ready``, and its next
#: ``rank_and_size`` in the epoch it was admitted to is its first init there, not a reset.
WARM_READY: Final = "elastic_warm_ready"
ELASTIC_EPOCH: Final = "elastic_epoch"
WORKER_ADDRESSES: Final = "worker_addresses"
PROGRESS: Final = "progress"
STACKS: Final = "stacks"
NODE_STANDING: Final = "node_standing"

#: The request header that carries the launcher's token.
TOKEN_HEADER: Final = "X-Elastic-Allreduce-Token"  # noqa: S105 - a header name
#: Bytes of randomness in a token (URL-safe base64 of them is what is sent).
_TOKEN_BYTES: Final = 32

#: Horovod names a worker ``<hostname>:<local rank>``; every slot is a host with local rank 0.
_LOCAL_RANK_SUFFIX: Final = ":0"


class WaitKind(str, enum.Enum):
    """How a slot waits at the readiness barrier."""

    #: A running member re-initialising after a reset (``rank_and_size``).
    RESET = "reset"
    #: A fresh process waiting for its first epoch (``elastic_ready``).
    FRESH = "fresh"


@dataclass(frozen=True)
class Admission:
    """A slot's answer at the barrier: its ranks in ``epoch`` (REMOVED: not admitted)."""

    epoch: int
    assignment: SlotAssignment

    @property
    def admitted(self) -> bool:
        return self.assignment.rank >= 0


@dataclass(frozen=True)
class Endpoint:
    """The launcher's rendezvous as a client needs it: ``host:port`` and the token its requests
    carry (None: a record from a launcher that required none)."""

    address: str
    #: A credential: kept out of repr (log lines, tracebacks).
    token: str | None = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        """The headers every request to this rendezvous carries."""
        return {} if self.token is None else {TOKEN_HEADER: self.token}


def new_token() -> str:
    """A fresh launcher token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


def authorized(sent: str | None, token: str) -> bool:
    """Whether a request's :data:`TOKEN_HEADER` value is ``token`` (compared in constant
    time, so the answer's timing tells nothing about how much of a guess was right)."""
    return sent is not None and hmac.compare_digest(sent.encode(), token.encode())


def worker_key(slot: str) -> str:
    """The key Horovod uses for a slot's requests (``<slot>:0``)."""
    return slot + _LOCAL_RANK_SUFFIX


def slot_of_worker_key(key: str) -> str:
    """The slot of a Horovod worker key (``<slot>:<local rank>``)."""
    return key.rsplit(":", 1)[0]


def encode_assignment(assignment: SlotAssignment) -> bytes:
    """The ``rank_and_size`` reply Horovod's elastic re-initialisation parses."""
    return ",".join(str(v) for v in assignment.as_tuple()).encode("ascii")


def decode_assignment(body: bytes) -> SlotAssignment:
    """Parse a ``rank_and_size`` reply; ProtocolError when it is not six ints."""
    values = _ints(body, "rank_and_size", 6)
    return SlotAssignment(*values)


def encode_admission(admission: Admission) -> bytes:
    """The ``elastic_ready`` reply: the epoch, then the six ints."""
    return f"{admission.epoch},".encode("ascii") + encode_assignment(admission.assignment)


def decode_admission(body: bytes) -> Admission:
    """Parse an ``elastic_ready`` reply; ProtocolError when it is not seven ints."""
    epoch, *values = _ints(body, "elastic_ready", 7)
    assignment = SlotAssignment(*values)
    return Admission(epoch, REMOVED if assignment.rank < 0 else assignment)


def encode_epoch(epoch: int) -> bytes:
    """The ``elastic_epoch`` reply."""
    return str(epoch).encode("ascii")


def decode_epoch(body: bytes) -> int:
    """Parse an ``elastic_epoch`` reply; ProtocolError when it is not one int."""
    return _ints(body, "elastic_epoch", 1)[0]


@dataclass(frozen=True)
class NodeStanding:
    """The launcher's view of one node: whether it still counts the node as a member (its
    member record is current, or held back while etcd was away), at which ring epoch."""

    epoch: int
    member: bool

    def encode(self) -> bytes:
        """The ``node_standing`` reply: ``"<epoch>,<1|0>"``."""
        return f"{self.epoch},{int(self.member)}".encode("ascii")

    @classmethod
    def decode(cls, body: bytes) -> NodeStanding:
        """Parse a ``node_standing`` reply; ProtocolError when it is not an epoch and 0 or 1."""
        epoch, member = _ints(body, NODE_STANDING, 2)
        if member not in (0, 1) or epoch < 0:
            raise ProtocolError(f"bad {NODE_STANDING} reply {body[:80]!r}: expected EPOCH,0|1")
        return cls(epoch, bool(member))


def standing_url(address: str, node: str) -> str:
    """Where an agent asks whether the launcher still counts its node as a member."""
    return f"{base_url(address)}/{NODE_STANDING}/{node}"


def _ints(body: bytes, what: str, count: int) -> list[int]:
    try:
        values = [int(part) for part in body.decode("ascii").split(",")]
    except (UnicodeDecodeError, ValueError):
        values = []
    if len(values) != count:
        raise ProtocolError(f"bad {what} reply {body[:80]!r}: expected {count} integers")
    return values


def host_port(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address (``[::1]:2379``)."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[v6]:port``; ProtocolError when malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProtocolError(f"bad address {address!r}: expected HOST:PORT or [IPV6]:PORT")
    return host, int(port)


def base_url(address: str) -> str:
    """``http://host:port`` of a rendezvous address (as stored: ``host:port``)."""
    host, port = split_host_port(address)
    return f"http://{host_port(host, port)}"


def ready_url(address: str, slot: str, *, warm: bool = False) -> str:
    """Where a fresh process waits for its first epoch (``warm``: a warm joiner, whose
    Horovod was initialised before, as a ring of one)."""
    return f"{base_url(address)}/{WARM_READY if warm else ELASTIC_READY}/{slot}"


def rank_and_size_url(address: str, slot: str) -> str:
    """Where a member re-initialising after a reset asks for its ranks (Horovod builds this
    one itself; tools and tests use it)."""
    return f"{base_url(address)}/{RANK_AND_SIZE}/{worker_key(slot)}"


def epoch_url(address: str, slot: str) -> str:
    """Where a process asks which epoch it was last admitted to."""
    return f"{base_url(address)}/{ELASTIC_EPOCH}/{slot}"


#: The largest ``worker_addresses`` body read (a worker's few interfaces and its key).
MAX_WORKER_ADDRESSES_BYTES: Final = 64 * 1024


@dataclass(frozen=True)
class WorkerAddresses:
    """A worker's notification service, as it registers it (``PUT /worker_addresses``): where it
    listens (interface -> (ip, port) pairs) and the key its messages are signed with."""

    addresses: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    secret_key: bytes

    def as_horovod(self) -> dict[str, list[tuple[str, int]]]:
        """The addresses in the form Horovod's notification client takes."""
        return {iface: list(pairs) for iface, pairs in self.addresses}


class _PlainDataUnpickler(pickle.Unpickler):
    """Reads only what pickle encodes without naming a class or function: tuples, lists,
    dicts, str, bytes, int, float, bool, None. Anything that needs a global is refused, so
    no code runs while reading (a general unpickler would run whatever the bytes name)."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only plain data is read")


def loads_plain(data: bytes) -> object:
    """Unpickle ``data`` if it is plain data only; ProtocolError otherwise (nothing runs)."""
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as exc:
        raise ProtocolError(f"not plain pickled data: {exc}") from None


def decode_worker_addresses(body: bytes) -> WorkerAddresses:
    """Parse a Horovod ``worker_addresses`` body (base64 of a pickled ``(addresses, key)``)
    with the plain-data loader; ProtocolError says what is wrong."""
    if len(body) > MAX_WORKER_ADDRESSES_BYTES:
        raise ProtocolError(f"worker_addresses body of {len(body)} bytes is too large")
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"worker_addresses body is not base64: {exc}") from None
    value = loads_plain(raw)
    if not (isinstance(value, tuple) and len(value) == 2):
        _bad_addresses(value)
    addresses, key = value
    if not isinstance(addresses, dict) or not isinstance(key, bytes) or not key:
        _bad_addresses(value)
    parsed = []
    for iface, pairs in addresses.items():
        if not isinstance(iface, str) or not isinstance(pairs, list):
            _bad_addresses(value)
        checked = []
        for pair in pairs:
            if not (
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], int)
                and 0 < pair[1] < 65536
            ):
                _bad_addresses(value)
            checked.append((pair[0], pair[1]))
        parsed.append((iface, tuple(checked)))
    return WorkerAddresses(tuple(parsed), key)


def _bad_addresses(value: object) -> NoReturn:
    text = repr(value)
    raise ProtocolError(
        "worker_addresses must be ({interface: [(ip, port), ...]}, secret key bytes), got "
        + (text if len(text) <= 120 else text[:117] + "...")
    )


#: The largest ``progress`` body read (a few numbers and a phase name).
MAX_PROGRESS_BYTES: Final = 4 * 1024
#: The largest ``stacks`` body read; a process's stacks are cut to fit (see StacksReport).
MAX_STACKS_BYTES: Final = 256 * 1024
#: The longest phase name, location or reason kept from a report.
MAX_NAME: Final = 200


def progress_url(address: str, slot: str) -> str:
    """Where a training process reports its progress."""
    return f"{base_url(address)}/{PROGRESS}/{slot}"


def stacks_url(address: str, slot: str) -> str:
    """Where a training process sends its stacks when asked."""
    return f"{base_url(address)}/{STACKS}/{slot}"


@dataclass(frozen=True)
class Commit:
    """A commit of the training state: its id (counts commits from the job's start, carried
    through syncs and checkpoints) and the script's ``step`` attribute at it, if it has one."""

    commit_id: int
    step: int | None = None

    def to_json(self) -> dict[str, int | None]:
        return {"commit_id": self.commit_id, "step": self.step}

    @classmethod
    def parse(cls, value: object, what: str) -> Commit | None:
        """None for None; ProtocolError for anything but ``{"commit_id": N, "step": N|null}``."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ProtocolError(f"{what} must be an object, got {value!r:.40}")
        step = value.get("step")
        return cls(
            _count(value, "commit_id", what),
            None if step is None else _count(value, "step", what),
        )


@dataclass(frozen=True)
class Synced:
    """What a process's last state sync gave it: the ring epoch it synced in and the commit."""

    epoch: int
    commit: Commit

    def to_json(self) -> dict[str, object]:
        return {"epoch": self.epoch, **self.commit.to_json()}

    @classmethod
    def parse(cls, value: object, what: str) -> Synced | None:
        """None for None; ProtocolError for anything but ``{"epoch": N, "commit_id": N,
        "step": N|null}``."""
        commit = Commit.parse(value, what)
        if commit is None:
            return None
        assert isinstance(value, dict)
        return cls(_count(value, "epoch", what), commit)


@dataclass(frozen=True)
class ProgressReport:
    """A training process's progress, as it reports it about once a second.

    ``ticks`` counts the steps and commits the process has finished since it started (it only
    grows, rollbacks included); ``step`` is the script's own step when the library knows it.
    ``phase`` names a long phase the watchdog must not take for a hang (``startup`` until the
    first tick, ``evaluation``, ``checkpoint``, ``sync``, or one the script marks); None while
    it trains."""

    incarnation: int
    ticks: int
    step: int | None = None
    phase: str | None = None
    #: Seconds the last step took (None: not measured yet).
    step_seconds: float | None = None
    #: The steps the script will take in all, when it said (``ea.report_step(step, total=N)``).
    total_steps: int | None = None
    #: Samples the last step took across the ring (the global batch), when the script said.
    samples_per_step: int | None = None
    #: Steps this process ran past a commit and lost to failures, in all (it only grows).
    rolled_back_steps: int = 0
    #: The state's last commit: its id and the script's step at it (``ea.State`` only).
    commit: Commit | None = None
    #: What the last sync gave this process: the ring epoch it synced in, and the commit.
    synced: Synced | None = None
    #: Checkpoints this process could not write (and skipped), in all (it only grows).
    checkpoints_skipped: int = 0
    #: Why the last one was skipped.
    checkpoint_skip: str | None = None
    #: Seconds its last gradient allreduce took from local gradients to reduced ones (its wait
    #: for the slowest rank); None when not measured.
    collective_seconds: float | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "incarnation": self.incarnation,
                "ticks": self.ticks,
                "step": self.step,
                "phase": self.phase,
                "step_seconds": self.step_seconds,
                "total_steps": self.total_steps,
                "samples_per_step": self.samples_per_step,
                "rolled_back_steps": self.rolled_back_steps,
                "commit": None if self.commit is None else self.commit.to_json(),
                "synced": None if self.synced is None else self.synced.to_json(),
                "checkpoints_skipped": self.checkpoints_skipped,
                "checkpoint_skip": self.checkpoint_skip,
                "collective_seconds": self.collective_seconds,
            }
        ).encode()

    @classmethod
    def decode(cls, body: bytes) -> ProgressReport:
        """Parse a ``progress`` body; ProtocolError says what is wrong."""
        fields = _json_object(body, "progress", MAX_PROGRESS_BYTES)
        seconds = _opt_seconds(fields, "step_seconds")
        return cls(
            incarnation=_count(fields, "incarnation", "progress", minimum=1),
            ticks=_count(fields, "ticks", "progress"),
            step=None if fields.get("step") is None else _count(fields, "step", "progress"),
            phase=_opt_name(fields, "phase", "progress"),
            step_seconds=seconds,
            total_steps=(
                None
                if fields.get("total_steps") is None
                else _count(fields, "total_steps", "progress", minimum=1)
            ),
            samples_per_step=(
                None
                if fields.get("samples_per_step") is None
                else _count(fields, "samples_per_step", "progress", minimum=1)
            ),
            rolled_back_steps=(
                0
                if fields.get("rolled_back_steps") is None
                else _count(fields, "rolled_back_steps", "progress")
            ),
            commit=Commit.parse(fields.get("commit"), "progress: commit"),
            synced=Synced.parse(fields.get("synced"), "progress: synced"),
            checkpoints_skipped=(
                0
                if fields.get("checkpoints_skipped") is None
                else _count(fields, "checkpoints_skipped", "progress")
            ),
            checkpoint_skip=_opt_name(fields, "checkpoint_skip", "progress"),
            collective_seconds=_opt_seconds(fields, "collective_seconds"),
        )


@dataclass(frozen=True)
class ProgressReply:
    """The launcher's answer to a progress report: whether to send the stacks now."""

    send_stacks: bool = False

    def encode(self) -> bytes:
        return json.dumps({"send_stacks": self.send_stacks}).encode()

    @classmethod
    def decode(cls, body: bytes) -> ProgressReply:
        fields = _json_object(body, "progress reply", MAX_PROGRESS_BYTES)
        flag = fields.get("send_stacks", False)
        if not isinstance(flag, bool):
            raise ProtocolError(f"progress reply: send_stacks must be true or false, got {flag!r}")
        return cls(flag)


@dataclass(frozen=True)
class StacksReport:
    """Where a process is, for the hang watchdog's diagnosis.

    ``collective`` names the collective the main thread waits in (a Horovod operation, or a
    compiled TensorFlow function, whose collectives run inside it), None when it is elsewhere;
    ``where`` is the innermost frame of the main thread outside TensorFlow and Horovod
    (``file:line in function``); ``stacks`` holds every thread's Python stack as text."""

    incarnation: int
    collective: str | None
    where: str
    stacks: str

    def encode(self) -> bytes:
        """The JSON body, with the stacks cut (and marked so) to fit MAX_STACKS_BYTES."""
        stacks = self.stacks
        while True:
            body = json.dumps(
                {
                    "incarnation": self.incarnation,
                    "collective": None if self.collective is None else self.collective[:MAX_NAME],
                    "where": self.where[:MAX_NAME],
                    "stacks": stacks,
                }
            ).encode()
            if len(body) <= MAX_STACKS_BYTES:
                return body
            keep = len(stacks) * (MAX_STACKS_BYTES - 2 * MAX_NAME) // len(body) - 64
            stacks = stacks[: max(0, keep)] + "\n[cut]"

    @classmethod
    def decode(cls, body: bytes) -> StacksReport:
        """Parse a ``stacks`` body; ProtocolError says what is wrong."""
        fields = _json_object(body, "stacks", MAX_STACKS_BYTES)
        stacks = fields.get("stacks")
        if not isinstance(stacks, str):
            raise ProtocolError("stacks: field 'stacks' must be a string")
        where = _opt_name(fields, "where", "stacks")
        return cls(
            incarnation=_count(fields, "incarnation", "stacks", minimum=1),
            collective=_opt_name(fields, "collective", "stacks"),
            where=where or "unknown",
            stacks=stacks,
        )


def _opt_seconds(fields: dict[str, object], name: str) -> float | None:
    """An optional duration of a progress report: None, or finite seconds >= 0."""
    seconds = fields.get(name)
    if seconds is None:
        return None
    if not (
        isinstance(seconds, (int, float))
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and seconds >= 0
    ):
        raise ProtocolError(f"progress: {name} must be seconds >= 0, got {seconds!r}")
    return float(seconds)


def _json_object(body: bytes, what: str, limit: int) -> dict[str, object]:
    if len(body) > limit:
        raise ProtocolError(f"{what} body of {len(body)} bytes is too large (limit {limit})")
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{what} body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} body must be a JSON object")
    return value


def _count(fields: dict[str, object], name: str, what: str, *, minimum: int = 0) -> int:
    value = fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ProtocolError(
            f"{what}: field {name!r} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _opt_name(fields: dict[str, object], name: str, what: str) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value.isprintable() or len(value) > MAX_NAME:
        raise ProtocolError(
            f"{what}: field {name!r} must be a printable string of at most {MAX_NAME} characters"
        )
    return value


def is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address (without brackets); False for names and IPv4."""
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False
