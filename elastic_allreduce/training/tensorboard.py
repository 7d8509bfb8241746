"""Rank 0's TensorBoard summaries: per-step scalars and a marker at each membership change.

With ``--tensorboard-dir DIR`` (``ELASTIC_ALLREDUCE_TENSORBOARD_DIR`` in the training
processes), :class:`~elastic_allreduce.training.api.State` attaches one :class:`RankZeroSummaries`
to
its process. Whoever is rank 0 of the current ring writes, with the ``tf.summary`` API, under
``DIR/train``:

- for every step the library counts (:func:`elastic_allreduce.progress.report_step`, called by
  ``ElasticData.advance``, the Keras feed, or a custom loop): the step's metrics (the Keras feed
  passes Keras' ``logs``, a custom loop ``metrics={"loss": ...}``), ``learning_rate`` (from the
  metrics, else read from the State's optimizer), ``samples_per_second`` (the step's global
  batch over its seconds) and ``ring/size``;
- at the start and after every reset, a marker at the step the ring trains from: the text
  ``ring/changes`` (``ring epoch 2: 3 -> 2 ranks (failure, 3 steps rolled back), from step
  40``) and the scalars ``ring/epoch`` and ``ring/size``.

Cheap per step: on rank 0 a step appends to three Python lists; elsewhere it is one call and
one test. Every FLUSH_SECONDS (checked at a step), at each marker, when the process stops being
rank 0 and at exit, one compiled function writes the buffered points with ``tf.summary.write``
and the writer is flushed. The price: a buffered point carries the wall time of its flush (at
most FLUSH_SECONDS late; its step is exact, markers carry their own time), and a rank 0 killed
outright loses what it had not flushed.

The event file is created at the first write, so a process that is never rank 0 creates none.
After rank 0 dies the oldest survivor, the next rank 0, writes a file of its own in the same
directory; TensorBoard reads the directory as one run. A step that was rolled back and run
again appears twice, before and after the marker.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import tensorflow as tf
from tensorboard.plugins.scalar import metadata as scalar_metadata  # type: ignore[import-untyped]

from elastic_allreduce import progress, runtime

log = logging.getLogger(__name__)

#: Where rank 0 writes, under the job's --tensorboard-dir (the launcher writes to "launcher").
SUBDIRECTORY: Final = "train"
#: Seconds between two writes of the buffered points.
FLUSH_SECONDS: Final = 5.0
#: Tags of the scalars and markers written besides the script's own metrics.
LEARNING_RATE: Final = "learning_rate"
SAMPLES_PER_SECOND: Final = "samples_per_second"
RING_SIZE: Final = "ring/size"
RING_EPOCH: Final = "ring/epoch"
RING_CHANGES: Final = "ring/changes"
#: Metric names written under another tag (Keras' LearningRateScheduler logs "lr").
_RENAMED: Final = {"lr": LEARNING_RATE}

#: Reads the current learning rate (None when unknown).
LearningRate = Callable[[], float | None]


class RankZeroSummaries:
    """One training process's summaries; writes only while the process is rank 0.

    :meth:`ring` says where the process stands (at the State's start and after each reset),
    :meth:`on_step` is the :mod:`elastic_allreduce.progress` step listener, :meth:`on_commit`
    covers scripts that report no steps (``ring/size`` at each commit), :meth:`close` flushes.
    Writing errors (a full disk, a directory that cannot be made) are logged once and stop the
    summaries, never the training.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        learning_rate: LearningRate | None = None,
        flush_seconds: float = FLUSH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.learning_rate = learning_rate
        self._flush_seconds = flush_seconds
        self._clock = clock
        self._writer: Any = None
        self._write_batch: Callable[[tf.Tensor, tf.Tensor, tf.Tensor], Any] | None = None
        #: Whether this process is rank 0 now (and writing has not failed).
        self._writing = False
        self._failed = False
        self._size: int | None = None
        #: Whether the process reported a step (then commits add no points).
        self._stepped = False
        self._tags: list[str] = []
        self._steps: list[int] = []
        self._values: list[float] = []
        self._flush_due = clock() + flush_seconds

    @property
    def writing(self) -> bool:
        """Whether this process writes now (it is rank 0)."""
        return self._writing

    def ring(self, *, rank: int, size: int, epoch: int, step: int, cause: str | None) -> None:
        """This process is ``rank`` of ``size`` in ring ``epoch``, training from ``step``;
        ``cause`` says why the ring changed (None: this process starts). Rank 0 writes the
        marker; a process that stops being rank 0 flushes what it buffered."""
        old, self._size = self._size, size
        was_writing = self._writing
        self._writing = rank == 0 and not self._failed
        if was_writing and not self._writing:
            self.flush()
        if not self._writing:
            return
        if old is None or cause is None:
            text = f"ring epoch {epoch}: {size} ranks (start), from step {step}"
        else:
            text = f"ring epoch {epoch}: {old} -> {size} ranks ({cause}), from step {step}"
        self._add(RING_SIZE, step, size)
        self.flush()
        self._write_marker(step, epoch, text)

    def on_step(
        self,
        step: int,
        seconds: float | None,
        samples: int | None,
        metrics: Mapping[str, float] | None,
    ) -> None:
        """Buffer one step's scalars (rank 0 only); write them when a flush is due."""
        self._stepped = True
        if not self._writing:
            return
        has_learning_rate = False
        if metrics:
            for name, value in metrics.items():
                tag = _RENAMED.get(name, name)
                has_learning_rate = has_learning_rate or tag == LEARNING_RATE
                self._add(tag, step, value)
        if not has_learning_rate and self.learning_rate is not None:
            rate = self.learning_rate()
            if rate is not None:
                self._add(LEARNING_RATE, step, rate)
        if samples is not None and seconds is not None and seconds > 0:
            self._add(SAMPLES_PER_SECOND, step, samples / seconds)
        if self._size is not None:
            self._add(RING_SIZE, step, self._size)
        if self._clock() >= self._flush_due:
            self.flush()

    def on_commit(self, step: int) -> None:
        """At a commit: ``ring/size`` at ``step`` when this process never reported a step (a
        script that counts no steps still shows its ring, at its commits)."""
        if self._writing and not self._stepped and self._size is not None:
            self._add(RING_SIZE, step, self._size)
            if self._clock() >= self._flush_due:
                self.flush()

    def flush(self) -> None:
        """Write the buffered points and flush the event file."""
        self._flush_due = self._clock() + self._flush_seconds
        if not self._tags or self._failed:
            return
        tags, steps, values = self._tags, self._steps, self._values
        self._tags, self._steps, self._values = [], [], []
        writer = self._open()
        if writer is None or self._write_batch is None:
            return
        try:
            self._write_batch(
                tf.constant(tags, tf.string),
                tf.constant(steps, tf.int64),
                tf.constant(values, tf.float32),
            )
            writer.flush()
        except (tf.errors.OpError, OSError) as exc:
            self._stop(exc)

    def close(self) -> None:
        """Flush and close the event file (at exit, and when the summaries end)."""
        self.flush()
        if self._writer is not None:
            try:
                self._writer.close()
            except (tf.errors.OpError, OSError) as exc:
                self._stop(exc)
            self._writer = None

    # -- writing -------------------------------------------------------------------------------

    def _add(self, tag: str, step: int, value: object) -> None:
        try:  # a number, or a numpy or tensor scalar
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return  # not a scalar: nothing to plot
        self._tags.append(tag)
        self._steps.append(step)
        self._values.append(number)

    def _write_marker(self, step: int, epoch: int, text: str) -> None:
        writer = self._open()
        if writer is None:
            return
        try:
            with writer.as_default():
                tf.summary.text(RING_CHANGES, text, step=step)
                tf.summary.scalar(RING_EPOCH, epoch, step=step)
            writer.flush()
        except (tf.errors.OpError, OSError) as exc:
            self._stop(exc)

    def _open(self) -> Any:  # noqa: ANN401 - a tf.summary.SummaryWriter (untyped)
        """The event file's writer, created at the first write."""
        if self._writer is not None or self._failed:
            return self._writer
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Flushed by this class only: a queue that never fills, a period that never ends.
            writer = tf.summary.create_file_writer(
                str(self.directory), max_queue=1 << 20, flush_millis=24 * 3600 * 1000
            )
        except (tf.errors.OpError, OSError) as exc:
            self._stop(exc)
            return None
        self._writer = writer
        self._write_batch = _batch_writer(writer)
        atexit.register(self.close)
        log.info("TensorBoard summaries of rank 0 in %s", self.directory)
        return writer

    def _stop(self, exc: BaseException) -> None:
        log.warning("TensorBoard summaries stopped: cannot write to %s: %s", self.directory, exc)
        self._failed = True
        self._writing = False
        self._tags, self._steps, self._values = [], [], []


def _batch_writer(writer: Any) -> Callable[[tf.Tensor, tf.Tensor, tf.Tensor], Any]:  # noqa: ANN401
    """One compiled function that writes a batch of scalar points (one call per flush, instead
    of several eager ops per point)."""
    metadata = scalar_metadata.create_summary_metadata(
        display_name=None, description=None
    ).SerializeToString()

    @tf.function(  # type: ignore[untyped-decorator]
        input_signature=[
            tf.TensorSpec([None], tf.string),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.float32),
        ],
        autograph=False,
    )
    def write_batch(tags: tf.Tensor, steps: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
        def body(index: tf.Tensor) -> tuple[tf.Tensor]:
            tf.summary.write(tags[index], values[index], step=steps[index], metadata=metadata)
            return (index + 1,)

        with writer.as_default():
            count = tf.size(tags)
            return tf.while_loop(lambda index: index < count, body, (tf.constant(0),))

    return write_batch  # type: ignore[no-any-return]


_attached: list[RankZeroSummaries] = []


def attach(learning_rate: LearningRate | None = None) -> RankZeroSummaries | None:
    """The process's summaries when the job has a TensorBoard directory, else None; the first
    call creates them and makes them a step listener (one event file per process)."""
    directory = runtime.contract().tensorboard_dir
    if not directory:
        return None
    if not _attached:
        summaries = RankZeroSummaries(Path(directory) / SUBDIRECTORY)
        progress.add_step_listener(summaries.on_step)
        _attached.append(summaries)
    summaries = _attached[0]
    if learning_rate is not None:
        summaries.learning_rate = learning_rate
    return summaries


def learning_rate_of(optimizer: Any) -> LearningRate:  # noqa: ANN401 - any Keras optimizer
    """Reads ``optimizer``'s learning rate (a variable, a number or a schedule); None when it
    has none that reads as a number."""

    def read() -> float | None:
        value = getattr(optimizer, "learning_rate", None)
        if isinstance(value, tf.keras.optimizers.schedules.LearningRateSchedule):
            value = value(optimizer.iterations)
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None

    return read
