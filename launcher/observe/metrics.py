"""The job's Prometheus metrics (``prometheus_client``), in a registry of the launcher's own.

Fed by :class:`launcher.observe.observer.JobObserver`; served at ``/metrics``. Names start
with ``elastic_``; the job id is the ``job_id`` label of ``elastic_job_info``.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client import Enum as StateMetric

from elastic_allreduce.records.values import JobPhase, JobSettings
from launcher.observe.events import EventKind, JobEvent

#: Seconds: the ring's re-form time is usually well under a second, a resize a few seconds.
REFORM_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class JobMetrics:
    """Every metric of one job; updated from events and the launcher's view."""

    def __init__(self, job_id: str, settings: JobSettings) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("elastic_job", "The job this launcher leads.", registry=r).info({"job_id": job_id})
        self.phase = StateMetric(
            "elastic_job_phase",
            "The job's phase.",
            states=[phase.value for phase in JobPhase],
            registry=r,
        )
        self.ring_epoch = Gauge("elastic_ring_epoch", "The current ring epoch.", registry=r)
        self.ring_size = Gauge("elastic_ring_size", "Ranks in the current ring epoch.", registry=r)
        self.target = Gauge("elastic_target_workers", "Worker nodes wanted now.", registry=r)
        Gauge("elastic_min_workers", "--min-workers.", registry=r).set(settings.min_workers)
        Gauge("elastic_max_workers", "--max-workers.", registry=r).set(settings.max_workers)
        self.restarts_used = Gauge(
            "elastic_restarts_used", "Restarts and replacements spent.", registry=r
        )
        Gauge("elastic_restarts_limit", "--max-restarts.", registry=r).set(settings.max_restarts)
        self.changes = Counter(
            "elastic_membership_changes",
            "Slots that joined, left or crashed, ring epochs re-formed, hangs found, states "
            "lost, checkpoint write failures and stragglers announced, by kind.",
            ["kind"],
            registry=r,
        )
        self.recoveries = Counter(
            "elastic_recoveries",
            "Ring epochs formed after the first, by cause (failure, resize).",
            ["cause"],
            registry=r,
        )
        self.reform_seconds = Histogram(
            "elastic_reform_seconds",
            "Seconds from deciding a ring epoch to every member released, by cause.",
            ["cause"],
            buckets=REFORM_BUCKETS,
            registry=r,
        )
        self.last_commit_step = Gauge(
            "elastic_last_commit_step", "The step of the last commit rank 0 reported.", registry=r
        )
        self.steps_per_second = Gauge(
            "elastic_steps_per_second",
            "Committed steps per second between the last two progress samples.",
            registry=r,
        )
        self.goodput = Gauge(
            "elastic_goodput_ratio",
            "Kept step time / wall time since the job started (see launcher/observe/goodput.py).",
            registry=r,
        )
        self.kept_step_seconds = Gauge(
            "elastic_kept_step_seconds",
            "Seconds of training steps kept (committed), counted at each step's time.",
            registry=r,
        )
        self.rollback_steps = Gauge(
            "elastic_rollback_steps",
            "Steps run after a commit and lost to a failure (run again).",
            registry=r,
        )
        self.rollback_seconds = Gauge(
            "elastic_rollback_seconds",
            "Seconds of training steps lost to rollbacks.",
            registry=r,
        )
        self.samples_per_second = Gauge(
            "elastic_samples_per_second",
            "Samples per second across the ring: the global batch over the median step time.",
            registry=r,
        )
        self.rank_step = Gauge(
            "elastic_rank_step",
            "Each ring member's last reported step (from its progress reports).",
            ["slot"],
            registry=r,
        )
        self.rank_step_seconds = Gauge(
            "elastic_rank_step_seconds",
            "Seconds each ring member's last step took.",
            ["slot"],
            registry=r,
        )
        self.phase.state(JobPhase.RUNNING.value)
        kinds = (
            EventKind.JOINED,
            EventKind.LEFT,
            EventKind.CRASHED,
            EventKind.REFORMED,
            EventKind.HUNG,
            EventKind.STATE_LOST,
            EventKind.CHECKPOINT_SKIPPED,
            EventKind.STRAGGLER,
        )
        for kind in kinds:
            self.changes.labels(kind.value)  # every series exists from the start, at 0

    def record(self, event: JobEvent) -> None:
        """Count a membership change (or the job's end)."""
        if event.kind is EventKind.FINISHED:
            self.phase.state((JobPhase.SUCCEEDED if event.succeeded else JobPhase.FAILED).value)
            return
        if event.kind in (EventKind.STARTED, EventKind.PROGRESS):
            return
        # A join, leave or crash counts each slot it concerns; a re-formed ring or a hang once.
        once = event.kind in (EventKind.REFORMED, EventKind.HUNG, EventKind.STATE_LOST)
        slots = 1 if once else max(1, len(event.slots))
        self.changes.labels(event.kind.value).inc(slots)
        if event.kind is EventKind.REFORMED and event.cause is not None:
            if event.cause != "start":
                self.recoveries.labels(event.cause).inc()
            if event.duration is not None:
                self.reform_seconds.labels(event.cause).observe(event.duration)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)
