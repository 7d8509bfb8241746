"""What a training process knows about its place in the job: slot, local ranks (from its
agent's contract, :func:`contract`) and current ring epoch."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError, ProtocolError
from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.rendezvous import protocol

_epoch: list[int] = []


def slot() -> str | None:
    """This process's slot id under `elastic-run`, else None."""
    return contract().slot


def local_rank() -> int | None:
    """This process's local rank as its script sees it under `elastic-run` (None outside): its
    slot's index on its node -- its GPU's index among the node's -- the same across restarts
    and whichever other slots are away. Horovod's own local rank is 0, since every slot is a
    Horovod host of its own (docs/architecture.md, "Slots are Horovod hosts")."""
    current = slot()
    return None if current is None else slot_index(current)


def local_size() -> int | None:
    """How many training processes this process's node runs (``--nproc-per-node``) under
    `elastic-run`, whether or not all of them are alive now; None outside. ConfigError when
    the agent's variable is not a positive whole number above this slot's index."""
    given = contract()
    if given.slot is None:
        return None
    if given.local_size is None:
        raise local_size_error("", given.slot, slot_index(given.slot))
    return given.local_size


def ring_epoch() -> int:
    """The ring epoch this process trains in (0 outside `elastic-run`)."""
    if not _epoch:
        _epoch.append(int(os.environ.get(env.RING_EPOCH, "0")))
    return _epoch[0]


def set_ring_epoch(epoch: int) -> None:
    """The ring epoch this process was admitted to (a warm joiner, when it joins)."""
    _epoch[:] = [epoch]


def refresh_ring_epoch() -> int:
    """Ask the launcher which epoch this process was admitted to (after a reset)."""
    address = os.environ.get(env.HOROVOD_RENDEZVOUS_ADDR)
    port = os.environ.get(env.HOROVOD_RENDEZVOUS_PORT)
    current = slot()
    if not (address and port and current):
        return ring_epoch()
    try:
        url = protocol.epoch_url(protocol.host_port(address, int(port)), current)
        with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - always http://
            epoch = protocol.decode_epoch(reply.read())
    except (OSError, ValueError, ProtocolError, urllib.error.URLError):
        return ring_epoch()
    _epoch[:] = [epoch]
    return epoch


# -- the agent -> training process contract ------------------------------------------------------


@dataclass(frozen=True)
class ProcessContract:
    """What an agent gives each training process it starts, as one record: the agent writes it
    into the process's environment (:meth:`environ`), the process reads it back once
    (:func:`contract`). Outside ``elastic-run`` every field is unset (None or its default).

    Horovod's rendezvous address is written here too, but Horovod reads it, and the bootstrap
    re-points it when a launcher takes over: the process reads that one where it is live.
    """

    #: The worker slot ("<node-id>.<index>").
    slot: str | None = None
    #: How many times the slot's process was started (1 for the first).
    incarnation: int = 1
    etcd: str | None = None
    job_id: str | None = None
    #: The node's lease as the process started (its agent keeps it alive; the process's
    #: record lives under it).
    node_lease: int | None = None
    #: Seconds the process's store calls wait out an unreachable etcd (--outage-timeout).
    outage_timeout: float = 0.0
    #: The node's --nproc-per-node, above the slot's index (None outside elastic-run).
    local_size: int | None = None
    #: The slot's GPU among the node's (None: the node was given none).
    gpu_index: int | None = None
    rendezvous_token: str | None = None
    #: Warm up at a ring of one before joining (--warm-join).
    warm_join: bool = False
    checkpoint_dir: str | None = None
    keep_checkpoints: int | None = None
    tensorboard_dir: str | None = None
    #: The slot's snapshot folder in shared memory (None: no snapshots).
    snapshot_dir: str | None = None
    #: This process's end of its agent's persistence channel (a file descriptor it inherits).
    persist_fd: int | None = None
    #: Where the bootstrap writes the error its script ended with, for the agent.
    error_file: str | None = None
    rendezvous_addr: str | None = None
    rendezvous_port: int | None = None
    gloo_iface: str | None = None

    def environ(self) -> dict[str, str]:
        """The variables that carry the record (an unset field: no variable, except the GPU
        index, always written: empty for none, so an inherited one never applies)."""
        values = {
            env.SLOT: self.slot,
            env.INCARNATION: str(self.incarnation),
            env.ETCD_ENDPOINTS: self.etcd,
            env.JOB_ID: self.job_id,
            env.NODE_LEASE: _text(self.node_lease),
            env.OUTAGE_TIMEOUT: str(self.outage_timeout),
            env.LOCAL_SIZE: _text(self.local_size),
            env.GPU_INDEX: _text(self.gpu_index) or "",
            env.RENDEZVOUS_TOKEN: self.rendezvous_token,
            env.WARM_JOIN: "1" if self.warm_join else None,
            env.CHECKPOINT_DIR: self.checkpoint_dir,
            env.KEEP_CHECKPOINTS: _text(self.keep_checkpoints),
            env.TENSORBOARD_DIR: self.tensorboard_dir,
            env.SNAPSHOT_DIR: self.snapshot_dir,
            env.PERSIST_FD: _text(self.persist_fd),
            env.ERROR_FILE: self.error_file,
            env.HOROVOD_RENDEZVOUS_ADDR: self.rendezvous_addr,
            env.HOROVOD_RENDEZVOUS_PORT: _text(self.rendezvous_port),
            env.HOROVOD_HOSTNAME: self.slot,
            env.HOROVOD_GLOO_IFACE: self.gloo_iface,
        }
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ProcessContract:
        """The record in ``environ``; one ConfigError naming the variable and its value for a
        value that does not parse."""
        slot = environ.get(env.SLOT) or None
        return cls(
            slot=slot,
            incarnation=_or(_whole(environ, env.INCARNATION, minimum=1), 1),
            etcd=environ.get(env.ETCD_ENDPOINTS) or None,
            job_id=environ.get(env.JOB_ID) or None,
            node_lease=_whole(environ, env.NODE_LEASE, minimum=1),
            outage_timeout=env.seconds_in(
                environ, env.OUTAGE_TIMEOUT, 0.0, below=86400, hint="the job's --outage-timeout"
            ),
            local_size=_local_size(environ, slot),
            gpu_index=_gpu_index(environ),
            rendezvous_token=environ.get(env.RENDEZVOUS_TOKEN) or None,
            warm_join=environ.get(env.WARM_JOIN) == "1",
            checkpoint_dir=environ.get(env.CHECKPOINT_DIR) or None,
            keep_checkpoints=_keep_checkpoints(environ),
            tensorboard_dir=environ.get(env.TENSORBOARD_DIR) or None,
            snapshot_dir=environ.get(env.SNAPSHOT_DIR) or None,
            persist_fd=_whole(environ, env.PERSIST_FD, minimum=0),
            error_file=environ.get(env.ERROR_FILE) or None,
            rendezvous_addr=environ.get(env.HOROVOD_RENDEZVOUS_ADDR) or None,
            rendezvous_port=_whole(environ, env.HOROVOD_RENDEZVOUS_PORT, minimum=1),
            gloo_iface=environ.get(env.HOROVOD_GLOO_IFACE) or None,
        )


#: The variables an agent never lets a training process inherit from its own environment
#: (an outer job's): it sets them or leaves them out.
NOT_INHERITED: Final = (env.RENDEZVOUS_TOKEN, env.WARM_JOIN, env.SNAPSHOT_DIR, env.PERSIST_FD)

#: The record the bootstrap read at the process's start (None: not read; outside elastic-run).
_fixed: list[ProcessContract] = []


def contract() -> ProcessContract:
    """This process's contract with its agent: the one the bootstrap read once at its start
    (:func:`fix_contract`), else -- a script or a test outside elastic-run -- the environment's
    now."""
    return _fixed[0] if _fixed else ProcessContract.from_environ(os.environ)


def fix_contract() -> ProcessContract:
    """Read the contract once, for the rest of the process (the bootstrap, at its start)."""
    _fixed[:] = [ProcessContract.from_environ(os.environ)]
    return _fixed[0]


def _text(value: int | None) -> str | None:
    return None if value is None else str(value)


def _whole(environ: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < minimum:
        raise ConfigError(
            f"{name}={raw!r}: give a whole number, at least {minimum} (the agent sets it)"
        )
    return int(raw)


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def slot_index(slot: str) -> int:
    """The slot's index on its node (its local rank); ConfigError for a malformed slot id."""
    try:
        return split_slot(slot)[1]
    except ValueError as exc:
        raise ConfigError(
            f"{env.SLOT}: {exc}; training processes are started by `elastic-run`"
        ) from None


def local_size_error(text: str, slot: str, index: int) -> ConfigError:
    """The error of a node size that is missing (``text`` empty) or not above the index."""
    return ConfigError(
        f"{env.LOCAL_SIZE}={text!r} is not the node's number of training processes (slot "
        f"{slot} has index {index}): training processes are started by `elastic-run`, "
        "whose agent sets it"
    )


def _local_size(environ: Mapping[str, str], slot: str | None) -> int | None:
    """The node's --nproc-per-node, above the slot's index; None outside elastic-run (or
    unset: :func:`elastic_allreduce.runtime.local_size` says so when asked)."""
    text = environ.get(env.LOCAL_SIZE)
    if slot is None or text is None:
        return None
    index = slot_index(slot)
    if not text.isdigit() or int(text) <= index:
        raise local_size_error(text, slot, index)
    return int(text)


def _gpu_index(environ: Mapping[str, str]) -> int | None:
    """The slot's GPU index (None when unset or empty); ConfigError unless a whole number."""
    text = environ.get(env.GPU_INDEX, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(
            f"{env.GPU_INDEX}={text!r} is not a GPU index: the agent sets it to 0, 1, ... "
            "(unset it to let TensorFlow use every GPU)"
        )
    return int(text)


def _keep_checkpoints(environ: Mapping[str, str]) -> int | None:
    raw = environ.get(env.KEEP_CHECKPOINTS)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{env.KEEP_CHECKPOINTS}={raw!r}: give a whole number of checkpoints, at least 1 "
            "(--keep-checkpoints)"
        )
    return value
