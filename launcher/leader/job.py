"""The launcher's job loop: one leader per job; executes the ring policy's decisions.

It wins leadership (:mod:`launcher.leader.leadership`: ``launcher/leader`` under its lease; a
second launcher for the same job stands by or is refused), serves the Gloo rendezvous, asks the
provisioner for the initial nodes, then loops: read the job from the store and the rendezvous, let
:class:`launcher.leader.policy.RingPolicy` and the hang watchdog (:mod:`launcher.leader.watchdog`)
decide, execute the decisions. The members' progress, reported to the rendezvous server, is written
to ``status/ranks`` every few seconds.

An etcd outage is weather: store calls retry for up to ``--outage-timeout`` while the ranks go
on training (they need no launcher until membership changes). etcd lets every lease expire
when it was away for longer than the TTL, so for a while after such an outage the launcher
holds back its decisions about vanished member and process records
(:class:`launcher.leader.leadership.OutageHold`): the agents and processes that lived through it
register again, the same node or process keeps its place, and only the records that stay gone are
handled as deaths. The launcher's own leader key is created again under a new lease; if another
launcher leads the job by then, this one stops without writing anything (``LeadershipLostError``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from elastic_allreduce import errors as ea_errors
from elastic_allreduce.errors import (
    ConfigError,
    MalformedValueError,
    StoreError,
    StoreUnavailableError,
)
from elastic_allreduce.records import keys
from elastic_allreduce.records.snapshot import JobSnapshot, SkipReporter, parse_job
from elastic_allreduce.records.values import (
    HangRecord,
    JobConfig,
    JobPhase,
    JobSettings,
    JobStatus,
    LeaderRecord,
    OnStateLoss,
    ProcPhase,
    RanksRecord,
    RingState,
    StragglerPolicy,
)
from elastic_allreduce.rendezvous.protocol import (
    Admission,
    Commit,
    host_port,
    new_token,
)
from elastic_allreduce.store import EtcdStore, KeyValue, Lease
from elastic_allreduce.store.cache import Inbox, PrefixCache, drain, new_inbox
from launcher.leader.leadership import Leadership, LeadershipLostError, OutageHold
from launcher.leader.policy import RingPolicy
from launcher.leader.rendezvous import ReadinessBoard, RendezvousService
from launcher.leader.state_loss import CheckpointSkipWatch, StateLossWatch
from launcher.leader.stragglers import Straggler, StragglerWatch
from launcher.leader.watchdog import (
    HangFound,
    HangWatchdog,
    ProgressBoard,
    RequestStacks,
    RingLook,
    ranks_record,
)
from launcher.observe import tensorboard
from launcher.observe.observer import JobObserver
from launcher.observe.server import DashboardServer
from launcher.provisioners.api import Provisioner
from launcher.vocabulary import (
    ChangeKind,
    Decision,
    Exit,
    FinishJob,
    JobView,
    Log,
    Member,
    MembershipChange,
    NodeTemplate,
    NotifyWorkers,
    Proc,
    ReleaseWaiters,
    SetDirective,
    StartNodes,
    StopNode,
    WriteRing,
)

log = logging.getLogger("elastic-run")

#: Seconds between two writes of ``status/ranks`` (only when a member's progress changed).
RANKS_INTERVAL: Final = 2.0
#: What ``status/hang`` keeps of the stacks (the log has them all): the first ranks not in a
#: collective, each cut to this many characters -- an etcd value is at most 1.5 MiB.
STORED_STACKS: Final = 8
STORED_STACK_CHARS: Final = 32 * 1024
#: Seconds a launcher asked to stop waits for etcd to record that (not --outage-timeout).
STOPPING_OUTAGE_WAIT: Final = 5.0


def _for_the_store(record: HangRecord) -> HangRecord:
    """The diagnosis with only the odd ones out's stacks, cut to fit a store value."""
    kept = [r.slot for r in record.ranks if r.collective is None][:STORED_STACKS]
    ranks = tuple(
        replace(r, stacks=r.stacks[:STORED_STACK_CHARS] if r.slot in kept else "")
        for r in record.ranks
    )
    return replace(record, ranks=ranks)


@dataclass(frozen=True)
class LaunchSettings:
    """One job as the user launched it."""

    workers: int
    job: JobSettings
    #: What every worker node is started with.
    nodes: NodeTemplate
    #: The address workers reach this launcher's rendezvous at (a pod's IP on Kubernetes).
    rendezvous_host: str = "127.0.0.1"

    @property
    def etcd(self) -> str:
        return self.nodes.etcd

    @property
    def job_id(self) -> str:
        return self.nodes.job_id


@dataclass(frozen=True)
class JobResult:
    """How the job ended."""

    succeeded: bool
    reason: str
    #: The job goes on: this launcher handed it over to the next one (SIGTERM on Kubernetes).
    handed_over: bool = False
    #: ... or it never led the job: a standby stopped while it waited (SIGINT or SIGTERM).
    standing_by: bool = False


#: Receives every membership change (joins, leaves, crashes, re-formed epochs) as it happens;
#: Kubernetes mode records them as Events. Called on the launcher's loop: must not block.
EventSink = Callable[[MembershipChange], None]


@dataclass(frozen=True)
class _Stop:
    reason: str


def stored_nodes(items: Iterable[KeyValue]) -> frozenset[str]:
    """The nodes that a job's records name as members or as ranks of its ring."""
    job = parse_job(items, 0)
    ranks = () if job.ring is None else job.ring.record.slots
    return frozenset(job.members) | {keys.split_slot(slot)[0] for slot in ranks}


def raised_at(exc: BaseException, frames: int = 3) -> str:
    """Where ``exc`` was raised in this project's code, innermost first ("launcher/leader/job.py:
    333 in _lead <- ..."): said before a launcher stops on an unexpected error, whose
    traceback a killed process never prints (the soak kills what is left of a failed job)."""
    root = _PACKAGES[0].parent
    ours = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if any(Path(frame.filename).resolve().is_relative_to(p) for p in _PACKAGES)
    ]

    def where(frame: traceback.FrameSummary) -> str:
        return f"{Path(frame.filename).resolve().relative_to(root)}:{frame.lineno} in {frame.name}"

    said = " <- ".join(where(f) for f in reversed(ours[-frames:]))
    # Raised deep in the store client: also the launcher's call that led there.
    caller = next(
        (
            f
            for f in reversed(ours[:-frames])
            if Path(f.filename).resolve().is_relative_to(_PACKAGES[0])
        ),
        None,
    )
    if caller is not None and not any(
        Path(f.filename).resolve().is_relative_to(_PACKAGES[0]) for f in ours[-frames:]
    ):
        said += f" <- ... <- {where(caller)}"
    return said or "a place outside this project's code"


#: This project's packages (their files are "ours" in :func:`raised_at`).
_PACKAGES: Final = (
    Path(__file__).resolve().parent.parent,  # launcher/
    Path(ea_errors.__file__).resolve().parent,  # elastic_allreduce/
)


class Launcher:
    """Leads one job to its end (see the module docstring)."""

    def __init__(
        self,
        settings: LaunchSettings,
        provisioner: Provisioner,
        on_event: EventSink | None = None,
        observer: JobObserver | None = None,
        *,
        standby: bool = False,
        hand_over_on_interrupt: bool = False,
    ) -> None:
        self.settings = settings
        #: SIGINT/SIGTERM hands the job over (its nodes keep running, the lease is given up so
        #: the next launcher adopts it at once) instead of failing it: Kubernetes, where the
        #: launcher Job's next pod takes over after a drain or an eviction.
        self.hand_over_on_interrupt = hand_over_on_interrupt
        self._handed_over = False
        self.provisioner = provisioner
        self.on_event = on_event
        #: Events file, metrics and dashboard (launcher.observe); None: nothing observed.
        self.observer = observer
        self._dashboard: DashboardServer | None = None
        self.store = EtcdStore(
            settings.etcd, settings.job_id, outage_timeout=settings.job.outage_timeout
        )
        #: Wakes the control loop: store changes (from the cache) and rendezvous arrivals.
        self._inbox: Inbox = new_inbox()
        self.board = ReadinessBoard(on_change=lambda: self._inbox.put("rendezvous"))
        self.progress = ProgressBoard()
        self.rendezvous = RendezvousService(
            self.board, wait_timeout=settings.job.wait_timeout + 60, progress=self.progress
        )
        self.watchdog = HangWatchdog(settings.job.hang_timeout)
        self.state_loss = StateLossWatch()
        self.checkpoint_skips = CheckpointSkipWatch()
        factor = settings.job.straggler_factor
        self.stragglers = StragglerWatch(factor) if factor > 0 else None
        self._ranks_written: RanksRecord | None = None
        self._ranks_due = 0.0
        self._ring_revision = 0
        self._epoch = 0
        self._skips = SkipReporter()
        #: Long enough for every survivor of an outage to notice its lost lease (TTL) and
        #: register again.
        self._hold = OutageHold(2.0 * settings.job.lease_ttl + 2.0)
        #: The leader key, the lease, standing by, taking over (launcher.leader.leadership).
        self.leadership = Leadership(
            self.store,
            settings.job_id,
            settings.job.lease_ttl,
            self._hold,
            self._log,
            standby=standby,
        )
        #: Leases of member and process records that etcd reported expired at a takeover:
        #: their records are taken as gone while etcd deletes them (:meth:`_expired_leases`).
        self._expired: frozenset[int] = frozenset()

    def run(self) -> JobResult:
        """Lead the job until it succeeds or fails.

        Once this launcher owns the job, however it stops, ``status/job`` says so: an
        interrupt fails the job with that reason, and an error is recorded before it is raised.
        """
        lease = self.leadership.grant()
        try:
            ended = self._lead_or_stand_by(lease)
            if ended is not None:
                return ended
            adopted = self._write_config()
            assert self.leadership.lease is not None  # become() may have granted a new one
            try:
                return self._lead(self.leadership.lease, adopted)
            except KeyboardInterrupt:
                if self.hand_over_on_interrupt:
                    return self._hand_over()
                # Asked to stop: record it, but do not wait out a long etcd outage for that.
                self.store.outage_timeout = min(self.store.outage_timeout, STOPPING_OUTAGE_WAIT)
                return self._fail("interrupted (SIGINT or SIGTERM to elastic-run)")
            except LeadershipLostError:
                raise
            except Exception as exc:
                outage = isinstance(exc, StoreUnavailableError)
                if outage:
                    self.store.outage_timeout = 0.0  # it stayed away past the deadline
                log.warning(
                    "[%s e%d launcher] stopping on %s %s, raised at %s",
                    self.settings.job_id,
                    self._epoch,
                    "an etcd outage past --outage-timeout:" if outage else "an unexpected",
                    type(exc).__name__,
                    raised_at(exc),
                )
                self._fail(f"the launcher stopped: {exc}")
                raise
        finally:
            if self._handed_over:
                self.provisioner.release()
            else:
                self.provisioner.close()
            self.rendezvous.stop()
            if self._dashboard is not None:
                self._dashboard.stop()
            if self.observer is not None:
                self.observer.close()
            if self.leadership.lease is not None:
                with contextlib.suppress(StoreError):
                    self.leadership.lease.revoke()
            self.store.close()

    def _lead_or_stand_by(self, lease: Lease) -> JobResult | None:
        """:meth:`Leadership.become`; a standby stopped while it waits (SIGINT, SIGTERM) leaves
        the job to its leader: nothing is recorded and no node is stopped."""
        try:
            ended = self.leadership.become(lease)
            return None if ended is None else JobResult(ended.succeeded, ended.reason)
        except KeyboardInterrupt:
            self._handed_over = True
            if not self.leadership.standby:
                return JobResult(False, "interrupted before this launcher led the job")
            reason = (
                "SIGTERM before this launcher led the job: the next one takes it over"
                if self.hand_over_on_interrupt
                else "stopped while standing by; the job goes on under its leader"
            )
            return JobResult(False, reason, handed_over=True, standing_by=True)

    def _hand_over(self) -> JobResult:
        """Leave the job to the next launcher: nodes keep running, nothing is recorded as
        failed, and the lease is revoked on the way out so that the successor need not wait
        for it to expire."""
        self._handed_over = True
        reason = "SIGTERM (a drain or an eviction?): the next launcher takes the job over"
        self._log(f"handing job {self.settings.job_id} over: {reason}")
        return JobResult(False, reason, handed_over=True)

    def stop(self, reason: str) -> None:
        """Ask the loop (from any thread) to end the job as failed, with ``reason``: for a
        program that embeds the launcher; the CLI's SIGINT and SIGTERM do the same."""
        self._inbox.put(_Stop(reason))

    def _lead(self, lease: Lease, adopted: bool) -> JobResult:
        # A new token for every launcher: only what reads the job's keys can use its rendezvous.
        token = new_token()
        port = self.rendezvous.start(self.settings.rendezvous_host, token)
        rendezvous = host_port(self.settings.rendezvous_host, port)
        dashboard = self._serve_dashboard()
        self.leadership.record = LeaderRecord(rendezvous, dashboard, token)
        adoption = self.store.get_prefix().items if adopted else ()
        # Before the workers learn this address: the nodes of the job it takes over count as
        # members until the policy has looked at them (a node whose lease lapsed asks).
        self.rendezvous.members = stored_nodes(adoption)
        self.leadership.publish(lease)
        self.leadership.write(
            keys.JOB_STATUS,
            lambda: JobStatus(JobPhase.RUNNING, None, self.leadership.stamp()).to_json(),
        )
        policy = RingPolicy(self.settings.job, rendezvous, time.monotonic(), self.settings.workers)
        self.provisioner.subscribe(lambda: self._inbox.put("provisioner"))
        if adopted:
            self._adopt(policy, adoption)
            nodes: list[str] = []
        else:
            nodes = self.provisioner.start_nodes(self.settings.workers)
            policy.nodes_started(nodes, time.monotonic())
        self._log(f"job {self.settings.job_id}: started nodes {nodes}; rendezvous at {rendezvous}")
        if self.observer is not None:
            self.observer.started(rendezvous, nodes)
        return self._loop(policy)

    def _adopt(self, policy: RingPolicy, items: Sequence[KeyValue]) -> None:
        """Take the job over from the store (see RingPolicy.adopt): the ring and its revision
        (this launcher's next epoch is a compare-and-swap on it), members, processes,
        directives, as ``items`` (the whole job, read before the leader record was written)
        hold them. Workers learn the new rendezvous address from the leader record."""
        self._expired = self._expired_leases(items)
        job = parse_job(self._live(items), 0)
        self._report_skipped(job)
        ring = None
        if job.ring is not None:
            ring = job.ring.record
            self._ring_revision = job.ring.mod_revision
            self._epoch = ring.epoch
        directives = {
            node: dict(stored.record.incarnations) for node, stored in job.directives.items()
        }
        # Right after an etcd outage the ring's nodes and processes register again: the
        # policy waits for them as long as the outage hold lasts (RingPolicy.adopt).
        for decision in policy.adopt(ring, self._view(job), directives, self._hold.seconds):
            self._execute(decision)
        if not policy.adopting:
            self._adopt_nodes(policy, job)
        self.leadership.restamp_directives()

    def _expired_leases(self, items: Iterable[KeyValue]) -> frozenset[int]:
        """The leases of member and process records that etcd reports expired. A takeover
        as etcd returns from an outage can read the job while etcd revokes the expired leases
        one by one: it would adopt nodes and processes about to vanish, and re-form the ring
        when they do, instead of waiting for them to register again."""
        leases = {
            kv.lease
            for kv in items
            if kv.lease is not None and kv.key.startswith((keys.MEMBERS, keys.PROCS))
        }
        expired = set()
        for lease in sorted(leases):
            try:
                if self.store.lease_remaining(lease) is None:
                    expired.add(lease)
            except StoreError as exc:
                self._log(f"could not ask etcd whether lease {lease:x} lives ({exc}): alive")
        if expired:
            self._log(
                f"took over as etcd deletes {len(expired)} expired leases of the job: their "
                "nodes and processes count as gone until they register again"
            )
        return frozenset(expired)

    def _live(self, items: Iterable[KeyValue]) -> list[KeyValue]:
        """``items`` without the member and process records under expired leases."""
        if not self._expired:
            return list(items)
        return [
            kv
            for kv in items
            if kv.lease not in self._expired or not kv.key.startswith((keys.MEMBERS, keys.PROCS))
        ]

    def _adopt_nodes(self, policy: RingPolicy, job: JobSnapshot) -> None:
        """Let the provisioner manage the adopted job's nodes (once: when the policy adopts);
        those it manages are replaced when lost, the others count as joined by themselves."""
        managed = self.provisioner.adopt(
            {node: stored.record for node, stored in job.members.items()}
        )
        policy.manage(managed)
        if managed:
            self._log(f"managing the nodes an earlier launcher started: {sorted(managed)}")

    def _serve_dashboard(self) -> str | None:
        """Start the dashboard, /metrics and /api on --metrics-port; its address, if served."""
        if self.observer is None or self.observer.options.metrics_port is None:
            return None
        host = self.settings.rendezvous_host
        self._dashboard = DashboardServer(self.observer, host, self.observer.options.metrics_port)
        address = host_port(host, self._dashboard.start())
        self._log(f"dashboard at http://{address}/ (metrics at /metrics)")
        return address

    def _fail(self, reason: str) -> JobResult:
        """Record that the job failed (best effort: etcd may be the reason; never over a
        successor's record) and say so."""
        try:
            self.leadership.write(
                keys.JOB_STATUS,
                lambda: JobStatus(JobPhase.FAILED, reason, self.leadership.stamp()).to_json(),
            )
        except LeadershipLostError as exc:
            log.warning("not recording the job's failure: %s", exc)
        except StoreError as exc:
            log.warning("could not record the job's failure in the store: %s", exc)
        if self.observer is not None:
            self.observer.finished(False, reason)
        self._log(f"job {self.settings.job_id} failed: {reason}")
        return JobResult(False, reason)

    def _write_config(self) -> bool:
        """Write ``config/job``, or read it back from a job whose launcher is gone (whether
        this launcher adopts a running job: then the stored settings are the job's)."""
        existing = self.store.get(keys.JOB_CONFIG)
        if existing is not None:
            phase, _ = self.leadership.stored_phase()
            if phase is not None and phase.final:
                raise ConfigError(
                    f"job {self.settings.job_id!r} already {phase.value} at "
                    f"{self.store.describe()}; choose a new --job-id"
                )
            try:
                stored = JobConfig.from_json(existing.key, existing.value)
            except MalformedValueError as exc:
                raise ConfigError(
                    f"job {self.settings.job_id!r} cannot be taken over: its config/job is "
                    f"unreadable ({exc}); choose a new --job-id"
                ) from exc
            self.settings = replace(self.settings, job=stored.settings)
            self.leadership.lease_ttl = stored.settings.lease_ttl
            self._log(f"taking over job {self.settings.job_id}, whose launcher is gone")
            return True
        nodes = self.settings.nodes
        config = JobConfig(
            self.settings.job,
            nodes.command,
            nodes.checkpoint_dir,
            nodes.workdir,
            nodes.tensorboard_dir,
            nodes.keep_checkpoints,
        )
        self.store.put(keys.JOB_CONFIG, config.to_json())
        return False

    def _loop(self, policy: RingPolicy) -> JobResult:
        cache = PrefixCache(self.store, self._inbox)
        try:
            while True:
                # Deadlines (stuck members, wait timeouts) need a step at least this often.
                for item in drain(self._inbox, timeout=0.25):
                    if isinstance(item, _Stop):
                        return self._fail(item.reason)
                    cache.apply(item)
                self.leadership.check()
                self.rendezvous.resend_pending()
                current = {kv.key: kv for kv in self._live(cache.items().values())}
                items = self._hold.items(current, time.monotonic())
                job = parse_job(items.values(), cache.revision)
                self._report_skipped(job)
                if self.observer is not None:
                    self.observer.update(job, policy.target_workers, policy.restarts_used)
                view = self._view(job)
                adopting = policy.adopting
                decisions = [
                    *policy.step(view),
                    *self._watch(policy, view),
                    *self._check_state(policy, view, job),
                ]
                if adopting and not policy.adopting:
                    self._adopt_nodes(policy, job)
                for decision in decisions:
                    if isinstance(decision, StartNodes):
                        started = self.provisioner.start_nodes(decision.count)
                        policy.nodes_started(started, time.monotonic())
                        self._log(f"started nodes {started}")
                        continue
                    result = self._execute(decision)
                    if result is not None:
                        return result
                self._write_ranks(policy)
                self.rendezvous.members = frozenset(view.members) | policy.awaited_nodes
                self.rendezvous.epoch = self._epoch
        finally:
            cache.close()

    def _watch(self, policy: RingPolicy, view: JobView) -> list[Decision]:
        """The hang watchdog's look at the ring; its findings become the policy's decisions."""
        decisions: list[Decision] = []
        look = RingLook(
            time.monotonic(),
            time.time(),
            policy.ring,
            policy.member_incarnations,
            self.progress.seen(),
            self.progress.stacks(),
        )
        found = self.watchdog.step(look)
        for item in found:
            if isinstance(item, Log):
                decisions.append(item)
            elif isinstance(item, RequestStacks):
                self.progress.request_stacks(item.slots)
            else:
                decisions += self._on_hang(item, policy, view)
        return decisions

    def _check_state(self, policy: RingPolicy, view: JobView, job: JobSnapshot) -> list[Decision]:
        """Whether a re-formed ring lost the newest commit (launcher.leader.state_loss): each loss
        is announced (log, events, metrics) and, with ``--on-state-loss fail``, fails the job.
        Checkpoints a process could not write, and stragglers (launcher.leader.stragglers), are
        announced the same way."""
        if job.progress is not None:
            record = job.progress.record
            commit_id, step = record.get("commit_id"), record.get("step")
            if isinstance(commit_id, int) and not isinstance(commit_id, bool):
                self.state_loss.saw(
                    Commit(commit_id, step if isinstance(step, int) and step >= 0 else None)
                )
        decisions: list[Decision] = []
        reports = {slot: seen.report for slot, seen in self.progress.seen().items()}
        for skipped in self.checkpoint_skips.step(reports):
            message = skipped.describe()
            decisions.append(Log(message))
            epoch = policy.ring.epoch if policy.ring is not None else 0
            decisions.append(
                MembershipChange(ChangeKind.CHECKPOINT_SKIPPED, epoch, (skipped.slot,), message)
            )
        ring = policy.ring
        if self.stragglers is not None and ring is not None and ring.state is RingState.RUNNING:
            for straggler in self.stragglers.step(ring.slots, reports):
                message = straggler.describe()
                decisions.append(Log(message))
                decisions.append(
                    MembershipChange(ChangeKind.STRAGGLER, ring.epoch, (straggler.slot,), message)
                )
                if self.settings.job.straggler_policy is StragglerPolicy.EVICT:
                    decisions += self._evict(policy, view, straggler, len(ring.slots))
            # A warm joiner when it asks to join (or, when the ring had no full window yet
            # then, as soon as it has one).
            for slot, stored in job.procs.items():
                warmup = stored.record.warmup_step
                if warmup is None:
                    continue
                newcomer = self.stragglers.newcomer(slot, stored.record.incarnation, warmup)
                if newcomer is None:
                    continue
                decisions.append(Log(newcomer.describe()))
                if newcomer.slow:
                    decisions.append(
                        MembershipChange(
                            ChangeKind.STRAGGLER, ring.epoch, (slot,), newcomer.describe()
                        )
                    )
        for lost in self.state_loss.step(reports.values()):
            message = lost.describe()
            decisions.append(Log(message))
            decisions.append(MembershipChange(ChangeKind.STATE_LOST, lost.epoch, (), message))
            if self.settings.job.on_state_loss is OnStateLoss.FAIL:
                decisions += policy.fail(f"{message} (--on-state-loss fail)", view)
        return decisions

    def _evict(
        self, policy: RingPolicy, view: JobView, straggler: Straggler, size: int
    ) -> list[Decision]:
        """``--straggler-policy evict``: replace the straggler's node when the ring would step
        faster without it and keeps --min-workers while the new node starts."""
        if not straggler.faster_without(size):
            return [Log(f"not evicting slot {straggler.slot}: {size} ranks step faster with it")]
        if size - 1 < self.settings.job.min_workers:
            return [
                Log(
                    f"not evicting slot {straggler.slot}: the ring would fall below "
                    f"--min-workers {self.settings.job.min_workers}"
                )
            ]
        return policy.evict(straggler.slot, f"a straggler, {straggler.factor:.1f}x", view)

    def _on_hang(self, found: HangFound, policy: RingPolicy, view: JobView) -> list[Decision]:
        record = found.record
        for line in record.describe().splitlines():
            self._log(line)
        for rank in record.ranks:
            if rank.stacks:
                log.info(
                    "[%s e%d launcher] stacks of rank %d (slot %s):\n%s",
                    self.settings.job_id,
                    self._epoch,
                    rank.rank,
                    rank.slot,
                    rank.stacks.rstrip(),
                )
        try:
            self.leadership.write(keys.HANG, _for_the_store(record).to_json())
        except StoreError as exc:
            log.warning("could not record the hang diagnosis in the store: %s", exc)
        if self.observer is not None:
            self.observer.hang(record, found.replace)
        if found.fail:
            odd = "; ".join(r.describe() for r in record.ranks if r.collective is None)
            reason = f"the ring hung twice at the same place: {odd or record.action}"
            return policy.fail(reason, view)
        return policy.replace_hung(found.replace, view)

    def _write_ranks(self, policy: RingPolicy) -> None:
        """``status/ranks`` when the members' progress changed, at most every RANKS_INTERVAL."""
        now = time.monotonic()
        ring = policy.ring
        if ring is None or ring.state is not RingState.RUNNING or now < self._ranks_due:
            return
        self._ranks_due = now + RANKS_INTERVAL
        record = ranks_record(ring, policy.member_incarnations, self.progress.seen(), time.time())
        written = self._ranks_written
        if written is not None and replace(written, written_at=0.0) == replace(
            record, written_at=0.0
        ):
            return
        try:
            self.leadership.write(keys.RANKS, record.to_json())
        except StoreError as exc:
            log.warning("could not write the ranks' progress to the store: %s", exc)
            return
        self._ranks_written = record
        if self.observer is not None:
            self.observer.ranks(record)

    def _view(self, job: JobSnapshot) -> JobView:
        hold = self._hold
        procs = {
            slot: Proc(
                slot,
                stored.record.incarnation,
                hold.registered(stored.key, stored.record.pid, stored.create_revision),
                finished=stored.record.phase is ProcPhase.FINISHED,
            )
            for slot, stored in job.procs.items()
        }
        members = {
            node: Member(
                node,
                stored.record.slots,
                stored.record.leaving,
                hold.registered(stored.key, stored.record.pid, stored.create_revision),
                frozenset(stored.record.unreachable),
            )
            for node, stored in job.members.items()
        }
        exits = sorted(job.exits.items(), key=lambda item: item[1].mod_revision)
        nodes = self.provisioner.node_states()
        return JobView(
            now=time.monotonic(),
            procs=procs,
            members=members,
            exits=tuple(
                Exit(
                    slot, incarnation, e.record.code, e.record.signal, e.record.tail, e.record.error
                )
                for (slot, incarnation), e in exits
            ),
            waiting=self.board.waiting(),
            scale_target=job.target.record.workers if job.target is not None else None,
            pending_nodes=nodes.pending,
            disrupted_nodes=nodes.disrupted,
            dead_nodes=nodes.dead,
        )

    def _report_skipped(self, job: JobSnapshot) -> None:
        for skipped in self._skips.new(job):
            log.warning(
                "[%s e%d launcher] ignoring key %r: %s",
                self.settings.job_id,
                self._epoch,
                skipped.key,
                skipped.reason,
            )

    def _execute(self, decision: Decision) -> JobResult | None:
        if isinstance(decision, Log):
            self._log(decision.message)
        elif isinstance(decision, MembershipChange):
            self._announce(decision)
        elif isinstance(decision, WriteRing):
            self._epoch = decision.ring.epoch
            revision = self.store.compare_and_swap(
                keys.RING,
                decision.ring.to_json(),
                expected_mod_revision=self._ring_revision,
                guard=self.leadership.guard(),
            )
            if revision is None and not self.leadership.leads():
                self.leadership.reclaim()
                revision = self.store.compare_and_swap(
                    keys.RING,
                    decision.ring.to_json(),
                    expected_mod_revision=self._ring_revision,
                    guard=self.leadership.guard(),
                )
            if revision is None:
                raise StoreError(
                    f"job {self.settings.job_id}: the ring was changed by someone else; "
                    "is a second launcher running?"
                )
            self._ring_revision = revision
            self.state_loss.formed(decision.ring.epoch)
        elif isinstance(decision, ReleaseWaiters):
            if any(a.rank >= 0 for _, a in decision.answers):
                self.rendezvous.clear_gloo_scopes()
                self.rendezvous.forget([slot for slot, _ in decision.answers])
            self.board.answer({slot: Admission(decision.epoch, a) for slot, a in decision.answers})
        elif isinstance(decision, StopNode):
            self._log(f"stopping node {decision.node} (scale-down)")
            self.provisioner.stop_node(decision.node)
        elif isinstance(decision, NotifyWorkers):
            self.rendezvous.notify(list(decision.slots), decision.timestamp)
        elif isinstance(decision, SetDirective):
            self.leadership.write(
                keys.directive(decision.node), self.leadership.directive(decision.incarnations)
            )
        elif isinstance(decision, FinishJob):
            return self._finish(decision)
        return None

    def _announce(self, change: MembershipChange) -> None:
        if self.on_event is not None:
            self.on_event(change)
        if self.observer is not None:
            self.observer.change(change)
        if self.settings.nodes.tensorboard_dir is not None:
            tensorboard.record_change(self.settings.nodes.tensorboard_dir, change)

    def _finish(self, decision: FinishJob) -> JobResult:
        phase = JobPhase.SUCCEEDED if decision.succeeded else JobPhase.FAILED
        self.leadership.write(
            keys.JOB_STATUS,
            lambda: JobStatus(phase, decision.reason, self.leadership.stamp()).to_json(),
        )
        if self.observer is not None:
            self.observer.finished(decision.succeeded, decision.reason)
        self._log(f"job {self.settings.job_id} {phase.value}: {decision.reason}")
        return JobResult(decision.succeeded, decision.reason)

    def _log(self, message: str) -> None:
        log.info("[%s e%d launcher] %s", self.settings.job_id, self._epoch, message)
