"""A training process's admission to its first ring epoch: the launcher's readiness barrier, then
Horovod's rank variables and what needs the epoch (the ring guard, the progress beacon) -- at
once, or, for a warm joiner, when its script enters its elastic run."""

from __future__ import annotations

import logging
import os
import sys
import urllib.request
from dataclasses import dataclass, replace
from http.client import HTTPException
from typing import Final

from elastic_allreduce import env
from elastic_allreduce.bootstrap import ipv6
from elastic_allreduce.bootstrap.follow import LeaderFollower, capture_registration
from elastic_allreduce.bootstrap.registration import Registration
from elastic_allreduce.bootstrap.ring_guard import RingGuard
from elastic_allreduce.bootstrap.sockets import GlooSockets
from elastic_allreduce.errors import ElasticAllreduceError
from elastic_allreduce.progress import REPORT_INTERVAL, Beacon
from elastic_allreduce.records.snapshot import read_ring
from elastic_allreduce.records.values import (
    NOT_ADMITTED_EXIT_CODE,
    ProcPhase,
    ProcRecord,
)
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.store import EtcdStore

log = logging.getLogger("elastic_allreduce.bootstrap")


def _progress_interval() -> float:
    hint = f"between progress reports; default {REPORT_INTERVAL:g}, 0 turns them off"
    return env.seconds(env.PROGRESS_INTERVAL, REPORT_INTERVAL, below=3600, hint=hint)


#: Seconds a fresh process waits for a new launcher when the one it waited at went away.
FOLLOW_TIMEOUT: Final = 60.0


def _wait_for_first_epoch(
    follower: LeaderFollower, relay: str, slot: str, *, warm: bool = False
) -> protocol.Admission:
    """Wait at the launcher's readiness barrier (through the relay) for this slot's first
    epoch; when the launcher goes away meanwhile and another takes the job over, wait again at
    the new one's (the relay follows it). ``warm``: a warm joiner's barrier."""
    url = protocol.ready_url(relay, slot, warm=warm)
    while True:
        asked = follower.endpoint
        try:
            with urllib.request.urlopen(url, timeout=None) as reply:  # noqa: S310 - http://
                return protocol.decode_admission(reply.read())
        except (OSError, HTTPException) as exc:
            if not follower.wait_for_move(asked, FOLLOW_TIMEOUT):
                raise
            log.info(
                "the launcher at %s went away while this process waited (%s); waiting at the "
                "new one",
                asked.address,
                exc,
            )


def job_has_trained(store: EtcdStore, slot: str) -> bool:
    """Whether some ring epoch of the job has run: then this process is a newcomer to ranks
    that hold a state (a restart, a replacement, a node that joins), and warms up before it
    joins (--warm-join) -- also when the forming epoch already names its slot, since the
    ranks there sync as soon as they are admitted. Before the first epoch ran, every process
    starts with the first ring, its code before the elastic run beside the others'."""
    try:
        ring = read_ring(store)
    except ElasticAllreduceError as exc:
        log.warning("slot %s: could not read the ring (%s); joining without a warm-up", slot, exc)
        return False
    return ring is not None and ring.trained


@dataclass
class Admission:
    """This process's admission to its first ring epoch (called once): wait at the launcher's
    readiness barrier, then set Horovod's rank variables and start what needs the epoch (the
    ring guard, the progress beacon). Exits with NOT_ADMITTED_EXIT_CODE when not admitted."""

    store: EtcdStore
    slot: str
    record: ProcRecord
    registration: Registration
    follower: LeaderFollower
    relay: str
    host: str
    port: int
    gloo: GlooSockets
    #: A warm joiner's admission (elastic_allreduce.training.warm), after its ring of one.
    warm: bool = False

    def __call__(self, warmup_step: float | None = None) -> int:
        """Wait for the first ring epoch; its number. ``warmup_step``: a warm joiner's seconds
        for one step of its warm-up, written to its record for the launcher first."""
        if warmup_step is not None:
            registration = self.registration
            registration.update(replace(registration.record, warmup_step=warmup_step))
        admission = _wait_for_first_epoch(self.follower, self.relay, self.slot, warm=self.warm)
        if not admission.admitted:
            print(f"slot {self.slot}: not admitted to any ring epoch; exiting", file=sys.stderr)
            raise SystemExit(NOT_ADMITTED_EXIT_CODE)
        ranks = admission.assignment.as_tuple()
        for name, value in zip(env.HOROVOD_RANK_VARIABLES, ranks, strict=True):
            os.environ[name] = str(value)
        os.environ[env.RING_EPOCH] = str(admission.epoch)
        os.environ[env.HOROVOD_ELASTIC] = "1"
        registration = self.registration
        registration.update(
            replace(registration.record, phase=ProcPhase.TRAINING, epoch=admission.epoch)
        )
        if protocol.is_ipv6(self.host):
            ipv6.serve_notifications_over_ipv6(self.host, self.port)
        RingGuard(self.store, self.slot, admission.epoch, self.gloo).start()
        Beacon(self.relay, self.slot, self.record.incarnation, _progress_interval()).start()
        capture_registration()
        return admission.epoch
