"""Read TensorBoard event files back with ``tf.compat.v1.train.summary_iterator``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf


@dataclass(frozen=True)
class Point:
    """One summary value: its file, step, tag, value (a float, or the text) and wall time."""

    file: str
    step: int
    tag: str
    value: float | str
    wall_time: float


def read_file(path: Path) -> list[Point]:
    """Every summary value of one event file; a record cut off at the end (a writer killed
    mid-write) ends the file."""
    points: list[Point] = []
    try:
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    array = tf.make_ndarray(value.tensor)
                    item = array.item() if array.size == 1 else array.tolist()
                    content: float | str = item.decode() if isinstance(item, bytes) else item
                else:
                    content = value.simple_value
                points.append(Point(path.name, event.step, value.tag, content, event.wall_time))
    except tf.errors.DataLossError:
        pass
    return points


def event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def read_dir(directory: Path) -> list[Point]:
    """The values of every event file in ``directory``."""
    return [point for path in event_files(directory) for point in read_file(path)]


def series(points: list[Point], tag: str) -> list[tuple[int, float | str]]:
    """``(step, value)`` of one tag, in the order written."""
    return [(p.step, p.value) for p in points if p.tag == tag]
