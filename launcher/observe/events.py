"""The job's event history: one typed record per membership change, commit sample or end of
the job, kept in memory and as JSON lines (``--events-file``) that ``elastic-run timeline``
draws. Lines are parsed field by field; a malformed line is skipped with its reason."""

from __future__ import annotations

import enum
import json
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from launcher.vocabulary import MembershipChange

_T = TypeVar("_T")

#: Seconds between two PROGRESS samples kept (a sample per commit would be noise).
PROGRESS_INTERVAL: Final = 1.0


class EventKind(str, enum.Enum):
    """What an event records."""

    STARTED = "Started"
    JOINED = "Joined"
    LEFT = "Left"
    CRASHED = "Crashed"
    REFORMED = "Reformed"
    #: The hang watchdog found the ring without progress (``slots``: the ranks it replaced).
    HUNG = "Hung"
    #: The ring restarted from an older commit than the newest (the message names the steps).
    STATE_LOST = "StateLost"
    #: A process could not write a checkpoint (a full disk, a write error) and skipped it.
    CHECKPOINT_SKIPPED = "CheckpointSkipped"
    #: A rank holds the ring back (its share of each step far above the others').
    STRAGGLER = "Straggler"
    #: The last commit as rank 0 reported it: ``step`` and ring ``size``.
    PROGRESS = "Progress"
    FINISHED = "Finished"


@dataclass(frozen=True)
class JobEvent:
    """One event. ``at`` is wall-clock seconds (for people and pictures only: no decision is
    taken on clocks); ``slots`` are in rank order for REFORMED."""

    at: float
    kind: EventKind
    epoch: int
    message: str = ""
    slots: tuple[str, ...] = ()
    cause: str | None = None
    #: REFORMED: seconds the ring took to re-form.
    duration: float | None = None
    #: PROGRESS: the committed step and the ring size.
    step: int | None = None
    size: int | None = None
    #: FINISHED: whether the job succeeded.
    succeeded: bool | None = None

    @classmethod
    def of_change(cls, change: MembershipChange, at: float) -> JobEvent:
        return cls(
            at,
            EventKind(change.kind.value),
            change.epoch,
            change.message,
            change.slots,
            change.cause.value if change.cause is not None else None,
            change.duration,
        )

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "at": round(self.at, 3),
            "kind": self.kind.value,
            "epoch": self.epoch,
            "message": self.message,
            "slots": list(self.slots),
        }
        optional = {
            "cause": self.cause,
            "duration": None if self.duration is None else round(self.duration, 4),
            "step": self.step,
            "size": self.size,
            "succeeded": self.succeeded,
        }
        record.update({name: value for name, value in optional.items() if value is not None})
        return record

    @classmethod
    def from_json(cls, value: object) -> JobEvent:
        """Parse one stored event; ValueError says what is wrong."""
        if not isinstance(value, dict):
            raise ValueError(f"an event must be a JSON object, got {value!r:.80}")
        at, epoch = value.get("at"), value.get("epoch")
        if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at):
            raise ValueError(f"'at' must be a number, got {at!r:.40}")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"'epoch' must be an integer, got {epoch!r:.40}")
        slots = value.get("slots", [])
        if not isinstance(slots, list) or not all(isinstance(s, str) for s in slots):
            raise ValueError("'slots' must be a list of strings")
        return cls(
            float(at),
            EventKind(value.get("kind")),
            epoch,
            _optional(value, "message", str) or "",
            tuple(slots),
            _optional(value, "cause", str),
            _optional(value, "duration", float),
            _optional(value, "step", int),
            _optional(value, "size", int),
            _optional(value, "succeeded", bool),
        )


def _optional(value: dict[str, Any], name: str, kind: type[_T]) -> _T | None:
    item = value.get(name)
    if item is None:
        return None
    if kind is float and isinstance(item, int) and not isinstance(item, bool):
        item = float(item)
    if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
        raise ValueError(f"{name!r} must be a {kind.__name__}, got {item!r:.40}")
    return item


def read_events(lines: Iterable[str]) -> tuple[list[JobEvent], list[str]]:
    """The events of an event file's lines, and a reason for each line that was skipped."""
    events: list[JobEvent] = []
    skipped: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            events.append(JobEvent.from_json(json.loads(line)))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            skipped.append(f"line {number}: {exc}")
    return events, skipped


def default_events_file(job_id: str) -> Path:
    """Where a job's events go without ``--events-file``: the temp folder, one file a job."""
    import tempfile  # noqa: PLC0415 - only for the default

    return Path(tempfile.gettempdir()) / "elastic-run" / f"{job_id}.events.jsonl"


class EventLog:
    """Appends events to a JSON-lines file (created with its folder), one flushed line each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: JobEvent) -> None:
        line = json.dumps(event.to_json(), separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            self._file.close()
