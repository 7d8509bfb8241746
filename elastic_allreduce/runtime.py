"""What a training process knows about its place in the job: slot and current ring epoch."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from elastic_allreduce import env
from elastic_allreduce.errors import ProtocolError
from elastic_allreduce.rendezvous import protocol

_epoch: list[int] = []


def slot() -> str | None:
    """This process's slot id under `elastic-run`, else None."""
    return os.environ.get(env.SLOT)


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
