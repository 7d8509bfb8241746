"""What a training process knows about its place in the job: slot and current ring epoch."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError, ProtocolError
from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.rendezvous import protocol

_epoch: list[int] = []


def slot() -> str | None:
    """This process's slot id under `elastic-run`, else None."""
    return os.environ.get(env.SLOT)


def local_rank() -> int | None:
    """This process's local rank as its script sees it under `elastic-run` (None outside): its
    slot's index on its node -- its GPU's index among the node's -- the same across restarts
    and whichever other slots are away. Horovod's own local rank is 0, since every slot is a
    Horovod host of its own (docs/architecture.md, "Slots are Horovod hosts")."""
    current = slot()
    if current is None:
        return None
    try:
        return split_slot(current)[1]
    except ValueError as exc:
        raise ConfigError(
            f"{env.SLOT}: {exc}; training processes are started by `elastic-run`"
        ) from None


def local_size() -> int | None:
    """How many training processes this process's node runs (``--nproc-per-node``) under
    `elastic-run`, whether or not all of them are alive now; None outside. ConfigError when
    the agent's variable is not a positive whole number above this slot's index."""
    index = local_rank()
    if index is None:
        return None
    text = os.environ.get(env.LOCAL_SIZE, "")
    if not text.isdigit() or int(text) <= index:
        raise ConfigError(
            f"{env.LOCAL_SIZE}={text!r} is not the node's number of training processes (slot "
            f"{slot()} has index {index}): training processes are started by `elastic-run`, "
            "whose agent sets it"
        )
    return int(text)


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
