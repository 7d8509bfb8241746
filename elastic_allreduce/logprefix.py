"""The prefix of every training process's output line: ``[<job> e<epoch> r<rank> <slot>] text``.

The agent writes it; tools that follow a job's output (benchmarks, tests, examples) parse it
here, so the format has one definition. ``e-`` / ``r-`` stand for a slot that is not (yet) a
member of a ring epoch. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_LINE: Final = re.compile(
    r"^\[(?P<job>\S+) e(?P<epoch>\d+|-) r(?P<rank>\d+|-) (?P<slot>\S+)\] ?(?P<text>.*)$"
)


@dataclass(frozen=True)
class OutputLine:
    """One prefixed line: who printed it, and what."""

    job: str
    epoch: int | None
    rank: int | None
    slot: str
    text: str


def prefix(job: str, epoch: int | None, rank: int | None, slot: str) -> str:
    """``<job> e<epoch> r<rank> <slot>`` (``e-`` / ``r-`` for None), without brackets."""
    return f"{job} e{_field(epoch)} r{_field(rank)} {slot}"


def format_line(job: str, epoch: int | None, rank: int | None, slot: str, text: str) -> str:
    """The whole line as the agent prints it (without the newline)."""
    return f"[{prefix(job, epoch, rank, slot)}] {text}"


def parse_line(line: str) -> OutputLine | None:
    """The parts of a prefixed line; None for any other line (the launcher's, Python's)."""
    match = _LINE.match(line.rstrip("\n"))
    if match is None:
        return None
    return OutputLine(
        match["job"],
        None if match["epoch"] == "-" else int(match["epoch"]),
        None if match["rank"] == "-" else int(match["rank"]),
        match["slot"],
        match["text"],
    )


def _field(value: int | None) -> str:
    return "-" if value is None else str(value)
