"""What `elastic-run status` shows: one snapshot of a job (:class:`JobView`), as text, JSON, or a
live terminal view (``--watch``, drawn with ``rich``).

The snapshot is read from the store (phase, ring, the members' progress in ``status/ranks``, the
last commit, the last hang) and, when the launcher's dashboard answers, its recent events. The
live view redraws whenever the job's keys change (a store watch) and at least every second; it
ends when the job does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from elastic_allreduce.records.snapshot import JobSnapshot, read_job
from elastic_allreduce.records.values import RankProgress
from elastic_allreduce.store import Store
from launcher.observe.events import JobEvent
from launcher.observe.observer import recent_events

#: Events shown under the ranks.
SHOWN_EVENTS: Final = 5
#: Seconds between two redraws when nothing in the store changed.
REDRAW_INTERVAL: Final = 1.0


@dataclass(frozen=True)
class StatusView:
    """A job at one moment, as `status` shows it."""

    job_id: str
    job: JobSnapshot
    #: Members' progress of the current ring epoch, by slot (empty: none reported).
    ranks: dict[str, RankProgress]
    events: tuple[JobEvent, ...]
    #: Why the dashboard's events are missing (None: shown, or no dashboard).
    events_error: str | None
    now: float

    @property
    def dashboard(self) -> str | None:
        return self.job.leader.record.dashboard if self.job.leader is not None else None


def gather(store: Store, job_id: str) -> StatusView:
    """Read the job (one store read) and, if its dashboard answers, its recent events."""
    job = read_job(store)
    events: list[JobEvent] = []
    error = None
    dashboard = job.leader.record.dashboard if job.leader is not None else None
    if dashboard is not None:
        try:
            events = recent_events(dashboard, count=SHOWN_EVENTS)
        except (OSError, ValueError) as exc:
            error = str(exc)
    return make_view(job_id, job, tuple(events), error, time.time())


def make_view(
    job_id: str, job: JobSnapshot, events: tuple[JobEvent, ...], error: str | None, now: float
) -> StatusView:
    """The view of a snapshot: the members' progress only if it is the current epoch's."""
    ring = job.ring.record if job.ring is not None else None
    reported = job.ranks.record if job.ranks is not None else None
    ranks = (
        {r.slot: r for r in reported.ranks}
        if reported is not None and ring is not None and reported.epoch == ring.epoch
        else {}
    )
    return StatusView(job_id, job, ranks, events, error, now)


def rank_progress(progress: RankProgress | None, now: float) -> str:
    """``step 153/1000, 1.2 s ago, 0.031 s/step`` (empty when nothing was reported)."""
    if progress is None:
        return ""
    parts = []
    if progress.step is not None:
        total = f"/{progress.total_steps}" if progress.total_steps else ""
        parts.append(f"step {progress.step}{total}")
    if progress.progressed_at is not None:
        parts.append(f"{max(0.0, now - progress.progressed_at):.1f} s ago")
    if progress.step_seconds is not None:
        parts.append(f"{progress.step_seconds:.3f} s/step")
    if progress.phase is not None:
        parts.append(f"in {progress.phase}")
    return ", ".join(parts)


def to_json(view: StatusView) -> dict[str, Any]:
    """The view as one JSON object (``status --json``)."""
    job = view.job
    ring = job.ring.record if job.ring is not None else None
    return {
        "job_id": view.job_id,
        "status": job.status.record.to_json() if job.status is not None else None,
        "ring": ring.to_json() if ring is not None else None,
        "ranks": [
            {"rank": rank, "slot": slot, **_progress_json(view.ranks.get(slot))}
            for rank, slot in enumerate(ring.slots if ring is not None else ())
        ],
        "members": sorted(job.members),
        "last_commit": job.progress.record.to_json() if job.progress is not None else None,
        "hang": job.hang.record.to_json() if job.hang is not None else None,
        "dashboard": view.dashboard,
        "events": [event.to_json() for event in view.events],
        "events_error": view.events_error,
        "skipped_keys": [{"key": s.key, "reason": s.reason} for s in job.skipped],
    }


def _progress_json(progress: RankProgress | None) -> dict[str, Any]:
    if progress is None:
        return {}
    record = progress.to_json()
    assert isinstance(record, dict)
    return {k: v for k, v in record.items() if k not in ("slot", "rank")}


def eta(view: StatusView) -> tuple[int, int, float | None] | None:
    """``(step, total, seconds left)`` of rank 0 when the script declared its total steps."""
    ring = view.job.ring.record if view.job.ring is not None else None
    first = view.ranks.get(ring.slots[0]) if ring is not None and ring.slots else None
    if first is None or first.step is None or not first.total_steps:
        return None
    left = max(0, first.total_steps - first.step)
    seconds = left * first.step_seconds if first.step_seconds is not None else None
    return first.step, first.total_steps, seconds


def render(view: StatusView) -> RenderableType:
    """The live view: the job's line, a progress bar with ETA, the ranks, recent events."""
    job = view.job
    status = job.status.record if job.status is not None else None
    ring = job.ring.record if job.ring is not None else None
    head = Text(f"job {view.job_id}: ", style="bold")
    head.append(status.phase.value if status is not None else "unknown", style="cyan")
    if status is not None and status.reason:
        head.append(f" ({status.reason})")
    parts: list[RenderableType] = [head]
    if ring is not None:
        parts.append(
            Text(
                f"ring epoch {ring.epoch}, {len(ring.slots)} ranks "
                f"({ring.state.value}, cause {ring.cause.value})"
            )
        )
    progress = eta(view)
    if progress is not None:
        step, total, seconds = progress
        left = "ETA unknown" if seconds is None else f"ETA {seconds:.0f} s"
        parts.append(ProgressBar(total=total, completed=step, width=40))
        parts.append(Text(f"step {step}/{total}, {left}"))
    table = Table("rank", "slot", "progress", box=None, pad_edge=False)
    for rank, slot in enumerate(ring.slots if ring is not None else ()):
        table.add_row(str(rank), slot, rank_progress(view.ranks.get(slot), view.now))
    parts.append(table)
    if job.hang is not None:
        parts.append(Text("last hang: " + job.hang.record.describe(), style="yellow"))
    for event in view.events:
        parts.append(Text(f"{event.kind.value} (epoch {event.epoch}): {event.message}"))
    if view.events_error is not None:
        parts.append(Text(f"(dashboard not reachable from here: {view.events_error})"))
    return Group(*parts)


def watch(store: Store, job_id: str, console: Console, *, until: Callable[[], bool]) -> StatusView:
    """Redraw the live view until the job ends (or ``until()``); the last view."""
    view = gather(store, job_id)
    with (
        Live(render(view), console=console, auto_refresh=False) as live,
        store.watch_prefix("") as changes,
    ):
        while not until():
            status = view.job.status
            if status is not None and status.record.phase.final:
                break
            changes.get(REDRAW_INTERVAL)  # a change, or the interval: redraw either way
            view = gather(store, job_id)
            live.update(render(view), refresh=True)
    return view
