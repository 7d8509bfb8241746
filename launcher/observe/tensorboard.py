"""The launcher's TensorBoard summaries: how long each re-formed ring took, by cause.

With ``--tensorboard-dir DIR`` (where rank 0 of the ring writes ``DIR/train``:
:mod:`elastic_allreduce.training.tensorboard`), the launcher writes under ``DIR/launcher``, for
every
ring epoch formed after the first, at step = the ring epoch: the scalar ``recovery/failure`` or
``recovery/resize`` (seconds from deciding the epoch to every member released, as in the
``elastic_reform_seconds`` histogram), the scalar ``ring/size`` and the text ``ring/reformed``
(``epoch 2 (failure): 2 ranks n1.0, n2.0 in 0.41 s``).

Without TensorFlow: the launcher never imports it (seconds of start-up and hundreds of MB for
a few numbers per recovery). The events are the ``tensorboard`` package's protos, framed by its
``RecordWriter`` (TFRecord framing with masked CRC32C); the package comes with TensorFlow and
costs about 0.15 s to import, once, and only with a directory. Its ``EventFileWriter`` is not
used: it opens files through ``tensorboard.compat.tf``, which imports TensorFlow when installed.
Each event is appended and flushed at once (re-forms are rare): a launcher killed outright
loses none.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Final

from elastic_allreduce.errors import ConfigError
from launcher.vocabulary import ChangeKind, MembershipChange

log = logging.getLogger(__name__)

#: Where the launcher writes, under the job's --tensorboard-dir.
SUBDIRECTORY: Final = "launcher"
#: Tags: ``recovery/<cause>`` (seconds), the new ring's size and a line per re-form.
RECOVERY_PREFIX: Final = "recovery/"
RING_SIZE: Final = "ring/size"
REFORMED: Final = "ring/reformed"
#: The epoch causes that are recoveries (the first epoch, "start", is not).
_RECOVERY_CAUSES: Final = frozenset({"failure", "resize"})


def resolve_directory(value: str | None) -> str | None:
    """``--tensorboard-dir`` as an absolute path, created if missing; None when not given.

    ConfigError, naming the flag, for an empty value, a path that is not a directory, one that
    cannot be created, or a Python without the ``tensorboard`` package."""
    if value is None:
        return None
    if not value.strip():
        raise ConfigError("--tensorboard-dir is empty: give a directory, or leave the flag out")
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--tensorboard-dir {path} exists and is not a directory")
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard-dir needs the tensorboard package (installed with TensorFlow) in the "
            "launcher's Python"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--tensorboard-dir {path} cannot be created: {exc}") from exc
    return str(path)


class LauncherSummaries:
    """Appends the launcher's events to one event file under ``directory``; a write that fails
    is logged once and ends the summaries, never the job."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        name = f"events.out.tfevents.{int(time.time()):010d}.{platform.node()}.{os.getpid()}"
        self.path = self.directory / f"{name}.launcher"
        self._started = False
        self._failed = False

    def change(self, change: MembershipChange) -> None:
        """Record a re-formed ring that was a recovery (failure or resize) and its duration."""
        cause = change.cause.value if change.cause is not None else None
        if change.kind is not ChangeKind.REFORMED or cause not in _RECOVERY_CAUSES:
            return
        if change.duration is None:
            return
        self.write(
            change.epoch,
            scalars={RECOVERY_PREFIX + str(cause): change.duration, RING_SIZE: len(change.slots)},
            text={
                REFORMED: f"epoch {change.epoch} ({cause}): {len(change.slots)} ranks "
                f"{', '.join(change.slots)} in {change.duration:.2f} s"
            },
        )

    def write(self, step: int, *, scalars: dict[str, float], text: dict[str, str]) -> None:
        """Append one event with these scalars and texts at ``step``."""
        if self._failed:
            return
        try:
            self._append(_encode(step, scalars, text, header=not self._started))
        except OSError as exc:
            self._failed = True
            log.warning("TensorBoard summaries stopped: cannot write %s: %s", self.path, exc)
            return
        self._started = True

    def _append(self, records: list[bytes]) -> None:
        from tensorboard.summary.writer.record_writer import (  # type: ignore[import-untyped]  # noqa: PLC0415
            RecordWriter,
        )

        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as handle:
            writer = RecordWriter(handle)
            for record in records:
                writer.write(record)
            writer.flush()


def _encode(
    step: int, scalars: dict[str, float], text: dict[str, str], *, header: bool
) -> list[bytes]:
    """The serialized events: the file's version first when ``header``, then one event with
    the scalars and texts as ``tf.summary.scalar`` and ``tf.summary.text`` write them (a
    float32 or string tensor of shape [], the "scalars" or "text" plugin)."""
    from tensorboard.compat.proto import (  # type: ignore[import-untyped]  # noqa: PLC0415
        event_pb2,
        summary_pb2,
        tensor_pb2,
        types_pb2,
    )
    from tensorboard.plugins.scalar import (  # type: ignore[import-untyped]  # noqa: PLC0415
        metadata as scalar_metadata,
    )
    from tensorboard.plugins.text import (  # type: ignore[import-untyped]  # noqa: PLC0415
        metadata as text_metadata,
    )

    values = []
    for tag, number in scalars.items():
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[float(number)])
        tensor.tensor_shape.SetInParent()  # shape []
        meta = scalar_metadata.create_summary_metadata(display_name=None, description=None)
        values.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta))
    for tag, line in text.items():
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[line.encode()])
        tensor.tensor_shape.SetInParent()
        meta = text_metadata.create_summary_metadata(display_name=None, description=None)
        values.append(summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta))
    now = time.time()
    event = event_pb2.Event(wall_time=now, step=step, summary=summary_pb2.Summary(value=values))
    records: list[bytes] = [event.SerializeToString()]
    if header:
        version = event_pb2.Event(wall_time=now, file_version="brain.Event:2")
        records.insert(0, version.SerializeToString())
    return records


_writers: dict[str, LauncherSummaries] = {}
_writers_lock = threading.Lock()


def record_change(tensorboard_dir: str, change: MembershipChange) -> None:
    """Record ``change`` under ``tensorboard_dir``/launcher (one event file per directory and
    process). Called on the launcher's loop: appends a few hundred bytes, at most, per call."""
    with _writers_lock:
        writer = _writers.get(tensorboard_dir)
        if writer is None:
            writer = _writers[tensorboard_dir] = LauncherSummaries(
                Path(tensorboard_dir) / SUBDIRECTORY
            )
    writer.change(change)
