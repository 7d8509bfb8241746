"""``elastic-run timeline EVENTS -o job.png``: one picture of a job's night -- which slot held
which rank when, the crashes, leaves and joins, and the committed steps per second."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from elastic_allreduce.errors import ConfigError
from launcher.observe.events import EventKind, JobEvent, read_events


@dataclass(frozen=True)
class Timeline:
    """What the picture shows, in seconds from the job's first event."""

    #: (start, end, epoch, slots in rank order) of each ring epoch that ran.
    epochs: tuple[tuple[float, float, int, tuple[str, ...]], ...]
    #: (time, kind, slots) of each crash, leave and join.
    marks: tuple[tuple[float, EventKind, tuple[str, ...]], ...]
    #: (time, steps per second) between progress samples.
    rates: tuple[tuple[float, float], ...]


def build(events: list[JobEvent]) -> Timeline:
    """The timeline of a job's events (any order: they are sorted by time)."""
    if not events:
        raise ConfigError("the events file holds no events: nothing to draw")
    ordered = sorted(events, key=lambda e: e.at)
    t0 = ordered[0].at
    end = ordered[-1].at - t0
    epochs: list[tuple[float, float, int, tuple[str, ...]]] = []
    marks = []
    samples: list[JobEvent] = []
    for event in ordered:
        at = event.at - t0
        if event.kind is EventKind.REFORMED:
            if epochs:
                start, _, epoch, slots = epochs[-1]
                epochs[-1] = (start, at, epoch, slots)
            epochs.append((at, end, event.epoch, event.slots))
        elif event.kind in (EventKind.CRASHED, EventKind.LEFT, EventKind.JOINED):
            marks.append((at, event.kind, event.slots))
        elif event.kind is EventKind.PROGRESS and event.step is not None:
            samples.append(event)
    rates = [
        (b.at - t0, (b.step - a.step) / (b.at - a.at))
        for a, b in itertools.pairwise(samples)
        if a.step is not None and b.step is not None and b.at > a.at and b.step >= a.step
    ]
    return Timeline(tuple(epochs), tuple(marks), tuple(rates))


def draw(timeline: Timeline, output: Path, title: str) -> None:
    """Write the picture (PNG) to ``output``."""
    import matplotlib  # noqa: PLC0415 - only this command needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    slots = sorted({slot for *_, members in timeline.epochs for slot in members})
    row = {slot: index for index, slot in enumerate(slots)}
    figure, (ranks, speed) = plt.subplots(
        2,
        1,
        figsize=(11, 2.5 + 0.35 * max(len(slots), 3)),
        sharex=True,
        gridspec_kw={"height_ratios": [max(len(slots), 3), 2]},
    )
    colors = plt.get_cmap("tab10")
    for start, end, epoch, members in timeline.epochs:
        for rank, slot in enumerate(members):
            ranks.broken_barh(
                [(start, max(end - start, 0.01))],
                (row[slot] - 0.4, 0.8),
                color=colors(rank % 10),
                alpha=0.85,
            )
        ranks.axvline(start, color="#999", linewidth=0.6)
        ranks.text(start, len(slots) - 0.4, f"e{epoch}", fontsize=7, color="#555")
    style = {
        EventKind.CRASHED: ("x", "#b71c1c"),
        EventKind.LEFT: ("v", "#e65100"),
        EventKind.JOINED: ("^", "#1b5e20"),
    }
    for at, kind, members in timeline.marks:
        marker, color = style[kind]
        for slot in members:
            if slot in row:
                ranks.plot(at, row[slot], marker=marker, color=color, markersize=9)
    from matplotlib.patches import Patch  # noqa: PLC0415

    most = max((len(members) for *_, members in timeline.epochs), default=0)
    handles = [Patch(color=colors(rank % 10), label=f"rank {rank}") for rank in range(most)]
    handles += [
        ranks.plot([], [], marker=m, color=c, linestyle="", label=k.value.lower())[0]
        for k, (m, c) in style.items()
    ]
    ranks.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ranks.set_yticks(range(len(slots)), slots)
    ranks.set_ylabel("slot (color: rank)")
    ranks.set_title(title)
    if timeline.rates:
        speed.plot([t for t, _ in timeline.rates], [r for _, r in timeline.rates], color="#1565c0")
    speed.set_ylabel("steps/s")
    speed.set_xlabel("seconds since the job started")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


def render_file(events_file: Path, output: Path) -> tuple[Timeline, list[str]]:
    """Read an events file, draw it; return the timeline and the lines that were skipped."""
    try:
        text = events_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the events file {str(events_file)!r}: {exc}") from exc
    events, skipped = read_events(text.splitlines())
    timeline = build(events)
    draw(timeline, output, f"{events_file.name}: {len(timeline.epochs)} ring epochs")
    return timeline, skipped
