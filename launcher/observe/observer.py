"""What the launcher tells observers: the one object behind the event file, the metrics, the
dashboard and the JSON API. The launcher's loop feeds it; HTTP threads read it (thread-safe)."""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.records.keys import split_slot
from elastic_allreduce.records.snapshot import JobSnapshot
from elastic_allreduce.records.values import HangRecord, JobPhase, JobSettings, RanksRecord
from launcher.observe.events import (
    PROGRESS_INTERVAL,
    EventKind,
    EventLog,
    JobEvent,
    default_events_file,
)
from launcher.observe.goodput import GoodputMeter
from launcher.observe.metrics import JobMetrics
from launcher.vocabulary import MembershipChange

#: Events and progress samples kept in memory for the dashboard (the file keeps them all).
KEPT_EVENTS: Final = 2000


@dataclass(frozen=True)
class ObserverSettings:
    """Where a job's events go, and whether (and where) the dashboard is served."""

    events_file: Path | None = None
    #: Port of the dashboard, /metrics and /api (0: a free one; None: not served).
    metrics_port: int | None = None


class JobObserver:
    """The job as observers see it (see the module docstring)."""

    def __init__(self, job_id: str, settings: JobSettings, options: ObserverSettings) -> None:
        self.job_id = job_id
        self.settings = settings
        self.options = options
        self.metrics = JobMetrics(job_id, settings)
        self._log = EventLog(options.events_file) if options.events_file else None
        self._lock = threading.Lock()
        self._events: collections.deque[JobEvent] = collections.deque(maxlen=KEPT_EVENTS)
        self._samples: collections.deque[JobEvent] = collections.deque(maxlen=KEPT_EVENTS)
        self._status: dict[str, Any] = {"job_id": job_id, "phase": JobPhase.RUNNING.value}
        self._last_sample: JobEvent | None = None
        #: Kept step time, rollbacks, samples/s (fed on the launcher's loop, under the lock).
        self.goodput = GoodputMeter(time.time())

    # -- fed by the launcher ----------------------------------------------------------------

    def started(self, rendezvous: str, nodes: list[str]) -> None:
        """The launcher leads the job and asked for its first nodes."""
        message = f"started nodes {nodes}; rendezvous at {rendezvous}"
        self._add(JobEvent(time.time(), EventKind.STARTED, 0, message))

    def change(self, change: MembershipChange) -> None:
        """A join, leave, crash or re-formed ring."""
        self._add(JobEvent.of_change(change, time.time()))

    def update(self, job: JobSnapshot, target: int, restarts_used: int) -> None:
        """The launcher's current view (called on every loop of the launcher)."""
        ring = job.ring.record if job.ring is not None else None
        hosts = {node: stored.record.host for node, stored in job.members.items()}
        progress = job.progress.record if job.progress is not None else None
        step = progress.get("step") if progress is not None else None
        with self._lock:
            self._status.update(
                target_workers=target,
                min_workers=self.settings.min_workers,
                max_workers=self.settings.max_workers,
                restarts_used=restarts_used,
                max_restarts=self.settings.max_restarts,
                members=sorted(hosts),
                ring=None
                if ring is None
                else {
                    "epoch": ring.epoch,
                    "state": ring.state.value,
                    "cause": ring.cause.value,
                    "ranks": [
                        {
                            "rank": rank,
                            "slot": slot,
                            "node": split_slot(slot)[0],
                            "host": hosts.get(split_slot(slot)[0]),
                        }
                        for rank, slot in enumerate(ring.slots)
                    ],
                },
                progress=None if progress is None else progress.to_json(),
            )
        self.metrics.target.set(target)
        self.metrics.restarts_used.set(restarts_used)
        if ring is not None:
            self.metrics.ring_epoch.set(ring.epoch)
            self.metrics.ring_size.set(len(ring.slots))
        if isinstance(step, int) and not isinstance(step, bool):
            with self._lock:
                self.goodput.commit(step, time.time())
            self._sample(step, progress.size if progress is not None else None, ring)
        self._publish_goodput()

    def hang(self, record: HangRecord, replaced: tuple[str, ...]) -> None:
        """The hang watchdog found the ring without progress (and replaced these slots)."""
        message = record.describe().splitlines()[0]
        self._add(JobEvent(time.time(), EventKind.HUNG, record.epoch, message, replaced))
        with self._lock:
            self._status["hang"] = {
                "epoch": record.epoch,
                "at": record.at,
                "action": record.action,
                "ranks": [r.describe() for r in record.ranks],
            }

    def ranks(self, record: RanksRecord) -> None:
        """The members' progress (each rank's last step, step time and phase)."""
        with self._lock:
            self._status["rank_progress"] = [rank.to_json() for rank in record.ranks]
            self.goodput.ranks(record.ranks)
        self._publish_goodput()
        self.metrics.rank_step.clear()
        self.metrics.rank_step_seconds.clear()
        for rank in record.ranks:
            if rank.step is not None:
                self.metrics.rank_step.labels(rank.slot).set(rank.step)
            if rank.step_seconds is not None:
                self.metrics.rank_step_seconds.labels(rank.slot).set(rank.step_seconds)

    def finished(self, succeeded: bool, reason: str) -> None:
        """The job ended (the launcher wrote its final status)."""
        with self._lock:
            phase = JobPhase.SUCCEEDED if succeeded else JobPhase.FAILED
            self._status.update(phase=phase.value, reason=reason)
            ring = self._status.get("ring") or {}
        event = JobEvent(time.time(), EventKind.FINISHED, int(ring.get("epoch", 0)), reason)
        self._add(replace(event, succeeded=succeeded))

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def _publish_goodput(self) -> None:
        """Put the goodput figures in the metrics and the status."""
        with self._lock:
            figures = self.goodput.read(time.time())
            self._status["goodput"] = asdict(figures)
        metrics = self.metrics
        if figures.ratio is not None:
            metrics.goodput.set(figures.ratio)
        metrics.kept_step_seconds.set(figures.kept_seconds)
        metrics.rollback_steps.set(figures.rollback_steps)
        metrics.rollback_seconds.set(figures.rollback_seconds)
        if figures.samples_per_second is not None:
            metrics.samples_per_second.set(figures.samples_per_second)

    # -- read by the dashboard --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The job now, as ``/api/status`` returns it."""
        with self._lock:
            status = dict(self._status)
            samples = list(self._samples)
        status["throughput"] = [
            {"at": s.at, "step": s.step, "size": s.size} for s in samples if s.step is not None
        ]
        return status

    def events(self) -> list[dict[str, Any]]:
        """The membership history, oldest first, as ``/api/events`` returns it."""
        with self._lock:
            return [event.to_json() for event in self._events]

    # -- internals ----------------------------------------------------------------------------

    def _sample(self, step: int, size: int | None, ring: object) -> None:
        now = time.time()
        last = self._last_sample
        if last is not None and (step == last.step or now - last.at < PROGRESS_INTERVAL):
            return
        epoch = int(getattr(ring, "epoch", 0))
        sample = JobEvent(now, EventKind.PROGRESS, epoch, step=step, size=size)
        if last is not None and last.step is not None and step > last.step:
            self.metrics.steps_per_second.set((step - last.step) / (now - last.at))
        self.metrics.last_commit_step.set(step)
        self._last_sample = sample
        with self._lock:
            self._samples.append(sample)
        if self._log is not None:
            self._log.write(sample)

    def _add(self, event: JobEvent) -> None:
        self.metrics.record(event)
        with self._lock:
            self._events.append(event)
        if self._log is not None:
            self._log.write(event)


def add_observer_flags(parser: argparse.ArgumentParser) -> None:
    """The launcher's observation flags (``elastic-run run``), as one argument group."""
    group = parser.add_argument_group(
        "observability", "what the launcher records and serves about the job"
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the dashboard page, Prometheus /metrics and the JSON API (/api/status, "
        "/api/events) on this port of the launcher's address (0: a free port; default: off)",
    )
    group.add_argument(
        "--events-file",
        metavar="FILE",
        help="append the job's events (joins, leaves, crashes, re-forms, progress) to this "
        "JSON-lines file, for `elastic-run timeline` (default: "
        "$TMPDIR/elastic-run/<job-id>.events.jsonl)",
    )


def observer_settings(args: argparse.Namespace, job_id: str) -> ObserverSettings:
    """The settings of :func:`add_observer_flags`' flags; ConfigError for a bad port."""
    port = args.metrics_port
    if port is not None and not 0 <= port < 65536:
        raise ConfigError(f"--metrics-port {port} is not a TCP port (0 for a free one, 1-65535)")
    events = Path(args.events_file) if args.events_file else default_events_file(job_id)
    return ObserverSettings(events_file=events.absolute(), metrics_port=port)


def recent_events(dashboard: str, count: int, timeout: float = 3.0) -> list[JobEvent]:
    """The last ``count`` membership events from a launcher's ``/api/events`` (progress
    samples left out); OSError when it does not answer, ValueError for a reply that is not a
    list of events (each event is parsed; malformed ones are skipped)."""
    url = f"http://{dashboard}/api/events"
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        raw = json.loads(reply.read())
    if not isinstance(raw, list):
        raise ValueError(f"/api/events did not return a list: {str(raw)[:80]}")
    events = []
    for item in raw:
        try:
            event = JobEvent.from_json(item)
        except ValueError:
            continue
        if event.kind is not EventKind.PROGRESS:
            events.append(event)
    return events[-count:]
