"""The agent: one per worker node. Registers the node, follows the job's leader and has the
node's training processes run (:mod:`launcher.node.processes` supervises them).

It keeps ``members/<node>`` alive under its lease, follows the leader's directives
(``directives/<node>``: restart a slot, replace a stuck one, stop one; a status or directive
another writer left is ignored), follows a launcher that takes the job over, probes its peers
(:mod:`launcher.node.probes`), turns SIGTERM into a graceful leave, and stops its processes when
the job ends. The lease stays the signal for what an agent cannot see: a node that is dead,
stopped as a whole or cut off.

An agent that cannot renew its lease asks the launcher whether it still counts the node
(``node_standing``): if so, etcd is away for everyone (an outage, which is weather) and the
processes train on; when etcd returns having let the lease expire, the node registers again
under a new lease, keeping its processes (their ``procs/<slot>`` records, under the node's
lease, are written again). Only a node the launcher no longer counts, or cannot
be reached from, is cut off: it stops its processes (:meth:`Agent._fence`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Final

from elastic_allreduce import env
from elastic_allreduce._process import print_stacks_on_sigusr1
from elastic_allreduce.codec import JsonValue
from elastic_allreduce.errors import ConfigError, ElasticAllreduceError, ProtocolError, StoreError
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import JobSnapshot, SkipReporter, Stored, parse_job
from elastic_allreduce.records.values import (
    Directive,
    JobConfig,
    JobStatus,
    MemberRecord,
    Ring,
    from_leader,
)
from elastic_allreduce.rendezvous.protocol import (
    Endpoint,
    NodeStanding,
    base_url,
    standing_url,
)
from elastic_allreduce.store import EtcdStore, Lease
from elastic_allreduce.store.cache import Inbox, PrefixCache, drain, new_inbox
from launcher.exit_codes import EXIT_LEADERLESS, exit_code
from launcher.node.probes import ProbeListener, Prober
from launcher.node.processes import Process, Processes, check_command
from launcher.vocabulary import AgentSettings

log = logging.getLogger(__name__)

#: Seconds beyond two lease TTLs a starting node waits for an unreachable launcher to be
#: replaced (a takeover) before it says that the launcher cannot be reached from this host.
REACHABLE_GRACE: Final = 5.0
_LEAVE: Final = "leave"

#: Seconds between two questions to the launcher while the lease cannot be renewed, and
#: the longest one may take (it is asked that long before the lease may lapse).
STANDING_INTERVAL: Final = 1.0
STANDING_TIMEOUT: Final = 1.0
#: Seconds between two log lines saying that the node rides out an etcd outage.
OUTAGE_NOTE_INTERVAL: Final = 10.0
#: Seconds a node keeps training for a job with no launcher (none took over) before it leaves.
LEADERLESS_GRACE: Final = 60.0
#: Seconds each look of a fenced node for etcd may take.
AWAIT_STORE_LOOK: Final = 2.0
#: Seconds a leaving node's store calls wait out an etcd outage (not --outage-timeout).
LEAVING_OUTAGE_WAIT: Final = 5.0
#: Seconds a store call of the loop may wait at least (and run past its deadline: the shortest
#: attempt the store makes).
STORE_CALL_MIN_WAIT: Final = 0.5
#: Seconds the processes of a node whose leave timed out get between SIGTERM and SIGKILL: rank 0
#: of ``ea.State`` writes its last commit to the checkpoint folder on SIGTERM (the Kubernetes
#: worker's grace period is the leave timeout plus 30 s).
LEAVE_STOP_GRACE: Final = 25.0


@dataclass(frozen=True)
class _Reach:
    """The prober's news: the peer nodes this node cannot reach now."""

    unreachable: frozenset[str]


class Agent:
    """Runs one node's training processes for one job (see the module docstring)."""

    def __init__(self, settings: AgentSettings) -> None:
        if settings.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {settings.nproc_per_node}")
        keys.validate_node_id(settings.node_id)
        self.settings = settings
        self.store = EtcdStore(settings.etcd, settings.job_id)
        #: Process exits, SIGTERM and the store's changes, in arrival order (see PrefixCache).
        self._events: Inbox = new_inbox()
        self._desired: dict[int, int] = dict.fromkeys(range(settings.nproc_per_node), 1)
        self._leaving = False
        self._leave_deadline: float | None = None
        self._ring: Ring | None = None
        self._lease: Lease | None = None
        self._skips = SkipReporter()
        #: What ``members/<node>`` says (rewritten on a leave and when peers become unreachable).
        self._member = MemberRecord(settings.host, settings.nproc_per_node, os.getpid())
        #: The member record changed since it was last written (a write that failed is retried).
        self._member_unsaved = False
        self._member_write_failing = False  # said once per streak of failed writes
        self._prober = Prober(lambda unreachable: self._events.put(_Reach(unreachable)))
        self._listener: ProbeListener | None = None
        self._next_standing = 0.0
        self._standing: NodeStanding | None = None
        self._next_outage_note = 0.0
        self._leaderless_since: float | None = None
        #: The lease of the leader key as last seen: only that launcher's status and
        #: directives are obeyed (records.values.from_leader).
        self._leader_lease: int | None = None
        self._ignored: dict[str, int] = {}
        self._leaderless_grace = env.seconds(
            env.LEADERLESS_GRACE,
            LEADERLESS_GRACE,
            below=86400,
            hint=f"a node waits for a launcher this long; default {LEADERLESS_GRACE:g}",
        )
        self._leave_timeout = env.seconds(
            env.LEAVE_TIMEOUT,
            settings.leave_timeout,
            below=86400,
            hint=f"a leaving node waits to be let go this long; default {settings.leave_timeout:g}",
        )
        #: The node's training processes (launcher.node.processes); their exits come back
        #: through the loop's events.
        self.processes = Processes(settings, self.store, self._exited, self._place)
        check_command(settings.command, settings.workdir)

    # -- entry point -------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until the job ends or this node has left; return the agent's exit code.

        A node cut off from etcd past its lease stops its processes (:meth:`_fence`), waits
        until etcd answers again and registers anew; it returns 0 if the job ended meanwhile.
        """
        settings = self.settings
        raw = self.store.get(keys.JOB_CONFIG)
        if raw is None:
            raise ConfigError(
                f"unknown job {settings.job_id!r} at {self.store.describe()}: start it with "
                "`elastic-run ...` first, or check --job-id and --etcd"
            )
        job_settings = JobConfig.from_json(raw.key, raw.value).settings
        max_workers = job_settings.max_workers
        self.processes.outage_timeout = self.store.outage_timeout = job_settings.outage_timeout
        self.processes.warm_join = job_settings.warm_join
        # Before registering: a SIGTERM right after registration must be a graceful leave.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        listener = self._listener = ProbeListener(settings.host)
        self._prober.start()
        self.processes.check_snapshot_root()
        try:
            while True:
                outcome = self._register_and_serve(max_workers)
                if outcome is not None:
                    return outcome
                if not self._await_store():
                    return 0
        finally:
            self._prober.close()
            listener.close()
            self.processes.close()
            self.store.close()

    def _register_and_serve(self, max_workers: int) -> int | None:
        """Register the node and run its processes; the exit code, or None when fenced."""
        settings = self.settings
        rejoining = self._lease is not None
        if self._lease is not None:
            # Its keys, if the server still holds them (an etcd outage, not a partition).
            with contextlib.suppress(StoreError):
                self.store.revoke_lease(self._lease.id)
        lease = self._lease = self.store.grant_lease(settings.lease_ttl)
        self.processes.node_lease = lease.id
        probe = self._listener.port if self._listener is not None else None
        member = self._member = MemberRecord(
            settings.host,
            settings.nproc_per_node,
            os.getpid(),
            probe=probe,
            unreachable=self._member.unreachable,  # the prober reports changes only
        )
        key = keys.member(settings.node_id)
        if self.store.create(key, member.to_json(), lease=lease) is None:
            lease.revoke()
            raise ConfigError(
                f"node id {settings.node_id!r} is already a member of job {settings.job_id!r}"
            )
        full = None if settings.provisioned else self._over_max_workers(key, max_workers)
        if full is not None:
            lease.revoke()
            if rejoining:
                log.warning("[%s node %s] %s", settings.job_id, settings.node_id, full)
                return 0
            raise ConfigError(full)
        cache = PrefixCache(self.store, self._events)
        try:
            rendezvous = self._wait_for_launcher(cache)
            if rendezvous is None:
                log.info(
                    "[%s node %s] left before the launcher appeared",
                    settings.job_id,
                    settings.node_id,
                )
                return 0
            if not rejoining:
                try:
                    rendezvous = self._reachable_launcher(cache, rendezvous)
                except ConfigError:
                    lease.revoke()
                    raise
                if rendezvous is None:
                    return 0
            for index, incarnation in self._desired.items():
                if incarnation > 0:
                    self.processes.start(index, incarnation, rendezvous)
            return self._serve(cache, rendezvous)
        finally:
            cache.close()

    def _over_max_workers(self, key: str, max_workers: int) -> str | None:
        """Why this node may not join (the job has --max-workers nodes before it), or None."""
        members = self.store.get_prefix(keys.MEMBERS)
        ahead = sorted(
            (kv.create_revision, kv.key)
            for kv in members
            if kv.malformed is None and not _leaving(kv.key, kv.value)
        )
        order = [k for _, k in ahead]
        if key not in order or order.index(key) < max_workers:
            return None
        others = ", ".join(k.removeprefix(keys.MEMBERS) for k in order[:max_workers])
        return (
            f"job {self.settings.job_id!r} already has its --max-workers {max_workers} nodes "
            f"({others}): this node was not added; start the job with a larger --max-workers, "
            "or join when a node has left"
        )

    def _fence(self, cut_off_for: float) -> None:
        """Stop every training process: the node was cut off from etcd past its lease TTL, so
        it cannot know whether the others re-formed the ring without it (a zombie rank would
        hold its GPU and might write a checkpoint of a ring that moved on)."""
        log.warning(
            "[%s node %s] cut off from etcd: no lease renewal for %.1f s (TTL %d s); stopping "
            "this node's training processes and registering again when etcd answers",
            self.settings.job_id,
            self.settings.node_id,
            cut_off_for,
            self.settings.lease_ttl,
        )
        self.processes.fence()
        self._ring = None
        # The next registration is a newcomer: every slot starts a new incarnation.
        self._desired = {
            index: self.processes.started.get(index, 0) + 1
            for index, wanted in self._desired.items()
            if wanted > 0
        }

    def _await_store(self) -> bool:
        """After a fence: wait until etcd answers; whether to register again (False: the job
        ended meanwhile, or the node was asked to leave)."""
        waited_since = time.monotonic()
        while True:
            try:
                # A short look each time: a SIGTERM meanwhile is heeded within seconds.
                with self.store.give_up_at(time.monotonic() + AWAIT_STORE_LOOK):
                    status = self.store.get(keys.JOB_STATUS)
                    leader = self.store.get(keys.LEADER)
            except StoreError as exc:
                if any(item == _LEAVE for item in drain(self._events, timeout=1.0)):
                    return False
                log.debug("etcd still unreachable: %s", exc)
                continue
            if leader is not None:
                self._leader_lease = leader.lease
            if status is not None and status.malformed is None:
                with contextlib.suppress(ElasticAllreduceError):
                    record = JobStatus.from_json(status.key, status.value)
                    if record.phase.final and from_leader(record.leader, self._leader_lease):
                        log.info(
                            "[%s node %s] the job ended while this node was cut off",
                            self.settings.job_id,
                            self.settings.node_id,
                        )
                        return False
            log.info(
                "[%s node %s] etcd answers again after %.1f s; registering again",
                self.settings.job_id,
                self.settings.node_id,
                time.monotonic() - waited_since,
            )
            self._events = new_inbox()
            return not self._leaving

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._events.put(_LEAVE)

    def _wait_for_launcher(self, cache: PrefixCache) -> Endpoint | None:
        """The launcher's rendezvous, or None if the node was asked to leave first (SIGTERM)."""
        deadline = time.monotonic() + self.settings.start_timeout
        while not self._leaving:
            leader = self._job(cache).leader
            endpoint = None if leader is None else leader.record.endpoint()
            if endpoint is not None:
                return endpoint
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfigError(
                    f"no launcher for job {self.settings.job_id!r} appeared within "
                    f"{self.settings.start_timeout:.0f} s"
                )
            self._handle(cache, drain(self._events, timeout=min(remaining, 1.0)))
        return None

    def _reachable_launcher(self, cache: PrefixCache, rendezvous: Endpoint) -> Endpoint | None:
        """The launcher's rendezvous once it answers from this host (None if the node was
        asked to leave first). A launcher that is gone is followed to the one that takes the
        job over (its leader key lapses within a lease TTL, then a standby or a restarted `run`
        writes its own), so only a rendezvous that stays unreachable is a ConfigError."""
        deadline = time.monotonic() + 2 * self.settings.lease_ttl + REACHABLE_GRACE
        while True:
            try:
                check_reachable(rendezvous)
                return rendezvous
            except ConfigError:
                failed = rendezvous
            while rendezvous == failed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    check_reachable(rendezvous)  # the last word: its error, or it answers now
                    return rendezvous
                self._handle(cache, drain(self._events, timeout=min(remaining, 1.0)))
                if self._leaving:
                    return None
                leader = self._job(cache).leader
                moved = None if leader is None else leader.record.endpoint()
                rendezvous = moved or failed
            log.info(
                "[%s node %s] the launcher changed while this node started; its rendezvous is "
                "at %s",
                self.settings.job_id,
                self.settings.node_id,
                rendezvous.address,
            )

    # -- the loop ----------------------------------------------------------------------------

    def _serve(self, cache: PrefixCache, rendezvous: Endpoint) -> int | None:
        node = self.settings.node_id
        changed = True
        while True:
            if not self._lease_holds(rendezvous):
                return None
            if changed:
                job = self._job(cache)
                self._prober.set_targets(
                    {
                        peer: (stored.record.host, stored.record.probe)
                        for peer, stored in job.members.items()
                        if peer != node and stored.record.probe is not None
                    }
                )
                if job.ring is not None:
                    self._ring = job.ring.record
                self.processes.remember({slot: p.record for slot, p in job.procs.items()})
                rendezvous = self._follow_leader(job, rendezvous)
                if self._ended(job.status):
                    return 0
                directive = job.directives.get(node)
                if directive is not None and self._obeyed(directive):
                    self._apply(directive.record, rendezvous)
            if self._orphaned():
                return EXIT_LEADERLESS
            if self._leaving:
                if not self.processes.running:
                    log.info("[%s node %s] left the job", self.settings.job_id, node)
                    return 0
                if self._leave_deadline is not None and (
                    time.monotonic() > self._leave_deadline or self._leaderless_since is not None
                ):
                    # Past the leave timeout, or no launcher to re-form the ring without this
                    # node (a job torn down): SIGTERM lets rank 0 save its last commit.
                    self._leave_deadline = None
                    self.processes.stop_all(grace=LEAVE_STOP_GRACE)
            elif not self.processes.running and not any(
                incarnation > 0 for incarnation in self._desired.values()
            ):
                return 0
            items = drain(self._events, timeout=self._wait_time())
            # No store call may keep the loop from its lease check: each gives up in time.
            with self.store.give_up_at(self._store_deadline()):
                changed = self._handle(cache, items)
                if self._member_unsaved:
                    self._save_member()
                self.processes.report_unreported()
            self.processes.kill_stopped()

    def _follow_leader(self, job: JobSnapshot, rendezvous: Endpoint) -> Endpoint:
        """The launcher's rendezvous now (a new launcher took the job over: its own), and since
        when the job has had none."""
        if job.leader is None:
            self._leaderless_since = self._leaderless_since or time.monotonic()
            return rendezvous
        self._leaderless_since = None
        moved = job.leader.record.endpoint()
        if moved is None or moved == rendezvous:
            return rendezvous
        log.info(
            "[%s node %s] a new launcher leads the job; its rendezvous is at %s",
            self.settings.job_id,
            self.settings.node_id,
            moved.address,
        )
        return moved

    def _orphaned(self) -> bool:
        """Whether the job has had no launcher for the leaderless grace (its launcher is gone
        for good and no standby took over): then this node stops its processes and leaves,
        rather than hold its machine (a GPU) for a job nobody leads."""
        since = self._leaderless_since
        if since is None or time.monotonic() - since < self._leaderless_grace:
            return False
        log.warning(
            "[%s node %s] the job has had no launcher for %.0f s (gone, and no standby took "
            "over): stopping this node's processes and leaving; start `elastic-run run` with "
            "the same --etcd and --job-id to take the job over",
            self.settings.job_id,
            self.settings.node_id,
            time.monotonic() - since,
        )
        self.processes.stop_all(grace=5.0)
        self.processes.running.clear()
        return True

    def _lease_holds(self, rendezvous: Endpoint) -> bool:
        """Whether the node goes on: False once it was fenced (cut off past its lease)."""
        lease = self._lease
        if lease is None:
            return True
        if time.monotonic() >= self._ask_at(lease):
            self._refresh_standing(rendezvous)
        overdue = lease.lost or time.monotonic() > lease.safe_until
        if not overdue or self._ride_out(lease):
            return True
        self._fence(time.monotonic() - lease.renewed_at)
        return False

    def _ask_at(self, lease: Lease) -> float:
        """When to ask the launcher whether it still counts this node: when the lease renewal
        is late enough that the answer must be in by the moment the lease may have lapsed."""
        if lease.lost:
            return 0.0
        return max(lease.safe_until - STANDING_TIMEOUT, lease.renewed_at + lease.ttl / 2)

    def _refresh_standing(self, rendezvous: Endpoint) -> None:
        """Ask the launcher whether it counts this node, at most once per STANDING_INTERVAL
        (counted from the answer: a launcher out of reach keeps the last "no" that long)."""
        if time.monotonic() < self._next_standing:
            return
        self._standing = ask_standing(rendezvous, self.settings.node_id, STANDING_TIMEOUT)
        self._next_standing = time.monotonic() + STANDING_INTERVAL

    def _ride_out(self, lease: Lease) -> bool:
        """The lease could not be renewed for its TTL, or etcd let it expire: whether the node
        carries on. It does when the launcher still counts it (etcd was away for everyone);
        an expired lease is then replaced and the member record written again."""
        if self._standing is None or not self._standing.member:
            return False
        now = time.monotonic()
        if not lease.lost and now >= self._next_outage_note:
            self._next_outage_note = now + OUTAGE_NOTE_INTERVAL
            log.warning(
                "[%s node %s] no lease renewal for %.1f s, but the launcher still counts "
                "this node: etcd is away for everyone, training goes on",
                self.settings.job_id,
                self.settings.node_id,
                now - lease.renewed_at,
            )
        if lease.lost:
            with self.store.give_up_at(self._store_deadline()):
                return self._register_again()
        return True

    def _register_again(self) -> bool:
        """After etcd let the lease expire: the member record again, under a new lease, and the
        records of the live processes (they were under the old one). False when another holds
        the member key (the node is fenced); when etcd did not answer in time, True: the node
        rides on while the launcher counts it, and the next turn of the loop tries again."""
        settings = self.settings
        lease = None
        try:
            if self._lease is not None:
                # etcd reports an expired lease before it deleted the lease's keys.
                self.store.revoke_lease(self._lease.id)
            lease = self.store.grant_lease(settings.lease_ttl)
            member = self._member.to_json()
            if self.store.create(keys.member(settings.node_id), member, lease=lease) is None:
                lease.revoke()
                return False
            self.processes.node_lease = lease.id
            for index, record in self.processes.records.items():
                slot = keys.slot_id(settings.node_id, index)
                # Only where absent: the process itself may have written a newer one already.
                self.store.create(
                    keys.proc(slot), replace(record, lease=lease.id).to_json(), lease=lease
                )
        except StoreError as exc:
            log.warning("[%s node %s] %s", settings.job_id, settings.node_id, exc)
            if lease is not None:
                with contextlib.suppress(StoreError):
                    lease.revoke()
            return True
        self._lease = lease
        self._member_unsaved = self._member_write_failing = False
        self._standing = None
        self._next_outage_note = 0.0
        log.info(
            "[%s node %s] etcd let this node's lease expire while it was away; registered "
            "again under a new lease, processes kept",
            settings.job_id,
            settings.node_id,
        )
        return True

    def _store_deadline(self) -> float:
        """When the loop's store calls must give up: in time for the question to the launcher
        that must be answered by the moment the lease may have lapsed (once past that, while
        the launcher counts this node: by the next such question)."""
        now = time.monotonic()
        lease = self._lease
        ask_at = 0.0 if lease is None else self._ask_at(lease) - STORE_CALL_MIN_WAIT
        if ask_at <= now:
            return max(self._next_standing, now + STORE_CALL_MIN_WAIT)
        return ask_at

    def _wait_time(self) -> float:
        """How long the loop may wait for events: until the next look at the processes, and
        no later than the next question to the launcher that the lease may call for."""
        now = time.monotonic()
        limit = 1.0 if self._lease is None else self._ask_at(self._lease) - now + 0.01
        if limit <= 0:
            limit = self._next_standing - now
        if self.processes.running:
            limit = min(limit, self.processes.next_check_in(now))
        return max(0.0, min(1.0, limit))

    def _job(self, cache: PrefixCache) -> JobSnapshot:
        """The job as the cache has it now; junk keys are logged once and skipped."""
        job = parse_job(cache.items().values(), cache.revision)
        if job.leader is not None:
            self._leader_lease = job.leader.lease
        for skipped in self._skips.new(job):
            log.warning(
                "[%s node %s] ignoring key %r: %s",
                self.settings.job_id,
                self.settings.node_id,
                skipped.key,
                skipped.reason,
            )
        return job

    def _ended(self, status: Stored[JobStatus] | None) -> bool:
        """Whether the job's leader says that the job has ended."""
        return status is not None and status.record.phase.final and self._obeyed(status)

    def _obeyed(self, stored: Stored[JobStatus] | Stored[Directive]) -> bool:
        """Whether a status or directive comes from the job's leader; another writer's is
        ignored (and said once per version of the key)."""
        if from_leader(stored.record.leader, self._leader_lease):
            return True
        if self._ignored.get(stored.key) != stored.mod_revision:
            self._ignored[stored.key] = stored.mod_revision
            log.warning(
                "[%s node %s] ignoring %s: not written by the job's leader (its stamp %s, the "
                "leader's lease %s)",
                self.settings.job_id,
                self.settings.node_id,
                stored.key,
                stored.record.leader,
                self._leader_lease,
            )
        return False

    def _handle(self, cache: PrefixCache, items: list[object]) -> bool:
        """Apply store changes, process exits and SIGTERM; return whether anything happened."""
        for item in items:
            if isinstance(item, Process):
                self.processes.on_exit(item)
            elif isinstance(item, _Reach):
                self._on_reach(item.unreachable)
            elif item == _LEAVE:
                self._leave()
            else:
                cache.apply(item)
        return bool(items)

    def _leave(self) -> None:
        if self._leaving:
            return
        self._leaving = True
        self._leave_deadline = time.monotonic() + self._leave_timeout
        # Leaving during an etcd outage: say so if etcd answers soon, else just go.
        self.store.outage_timeout = min(self.store.outage_timeout, LEAVING_OUTAGE_WAIT)
        self._member = replace(self._member, leaving=True)
        self._save_member()
        log.info(
            "[%s node %s] SIGTERM: leaving the job gracefully",
            self.settings.job_id,
            self.settings.node_id,
        )

    def _on_reach(self, unreachable: frozenset[str]) -> None:
        """Say in the member record which peers this node's probes cannot reach (the launcher
        leaves one side of such a pair out of the ring until they reach each other again)."""
        prefix = f"[{self.settings.job_id} node {self.settings.node_id}]"
        if unreachable:
            log.warning("%s cannot reach peer nodes %s", prefix, ", ".join(sorted(unreachable)))
        else:
            log.info("%s reaches every peer node again", prefix)
        self._member = replace(self._member, unreachable=tuple(sorted(unreachable)))
        self._save_member()

    def _save_member(self) -> None:
        """Write the member record as this agent has it now; when etcd does not take it in
        time, the loop tries again on its next turns (registering again writes it too)."""
        self._member_unsaved = True
        if self._lease is None or self._lease.lost:
            return
        try:
            self.store.put(
                keys.member(self.settings.node_id), self._member.to_json(), lease=self._lease
            )
        except StoreError as exc:
            if not self._member_write_failing:
                log.warning(
                    "[%s node %s] could not write its member record yet (trying again): %s",
                    self.settings.job_id,
                    self.settings.node_id,
                    exc,
                )
            self._member_write_failing = True
            return
        self._member_unsaved = self._member_write_failing = False

    def _apply(self, directive: Directive, rendezvous: Endpoint) -> None:
        """Run the incarnation of each slot that the leader's directive names (0: none)."""
        self._desired = {i: directive.get(i) for i in range(self.settings.nproc_per_node)}
        for index, incarnation in self._desired.items():
            proc = self.processes.running.get(index)
            if proc is not None and (incarnation == 0 or proc.incarnation < incarnation):
                self.processes.replace(index, stacks=incarnation > 0)
                continue
            started = self.processes.started.get(index, 0)
            if proc is None and incarnation > started and not self._leaving:
                self.processes.start(index, incarnation, rendezvous)

    def _exited(self, proc: Process) -> None:
        """A process ended (its output thread says): to the loop's current events (a fence
        replaces the inbox)."""
        self._events.put(proc)

    def _place(self, slot: str) -> tuple[int | None, int | None]:
        """The slot's ring epoch and rank, as far as this agent knows (None: not a member)."""
        ring = self._ring
        if ring is not None and slot in ring.slots:
            return ring.epoch, ring.slots.index(slot)
        return None, None


def _leaving(key: str, value: JsonValue) -> bool:
    """Whether a member record says its node is leaving (malformed ones count as not)."""
    try:
        return MemberRecord.from_json(key, value).leaving
    except ElasticAllreduceError:
        return False


def check_reachable(rendezvous: Endpoint, timeout: float = 5.0) -> None:
    """ConfigError unless the launcher's rendezvous answers HTTP from this host (any status:
    a key that does not exist is enough)."""
    url = base_url(rendezvous.address) + "/elastic-run/reachable"
    request = urllib.request.Request(url, headers=rendezvous.headers())  # noqa: S310 - http://
    try:
        with urllib.request.urlopen(request, timeout=timeout):  # noqa: S310 - always http://
            return
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"the launcher's rendezvous at {rendezvous.address} cannot be reached from this host "
            f"({exc}): start the job with `elastic-run run --host ADDRESS`, ADDRESS being "
            "one of the launcher machine's addresses that this host can reach"
        ) from exc


def ask_standing(rendezvous: Endpoint, node: str, timeout: float = 1.0) -> NodeStanding | None:
    """The launcher's answer whether it counts ``node`` as a member; None when it cannot be
    reached or answers nonsense (both mean: treat the node as cut off)."""
    url = standing_url(rendezvous.address, node)
    request = urllib.request.Request(url, headers=rendezvous.headers())  # noqa: S310 - http://
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - http://
            return NodeStanding.decode(reply.read(64))
    except (OSError, ProtocolError) as exc:
        log.info(
            "launcher at %s did not say whether node %s is a member: %s",
            rendezvous.address,
            node,
            exc,
        )
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m launcher.node.agent SETTINGS_JSON``: how the local provisioner starts agents."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    print_stacks_on_sigusr1()
    raw = json.loads((sys.argv[1:] if argv is None else list(argv))[0])
    raw["command"] = tuple(raw["command"])
    try:
        return Agent(AgentSettings(**raw)).run()
    except ElasticAllreduceError as exc:
        print(f"elastic-run agent: error: {exc}", file=sys.stderr)
        return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
