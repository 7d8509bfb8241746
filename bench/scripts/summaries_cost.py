"""Benchmark probe: the CPU rank 0's TensorBoard summaries cost a training process.

Run by bench item 10 (bench/items/observability.py) in a process of its own, so that the
suite's process never imports TensorFlow. Times, with ``time.process_time()`` (every thread of
this process: TensorFlow may run an op on a thread of its own) and after a warm-up:

* ``on_step``: one call of :meth:`RankZeroSummaries.on_step`, the step listener
  ``report_step`` calls on rank 0, with what bench/scripts/hvd_steps.py passes under
  ``--summaries`` (the global batch, ``{"loss": <scalar tensor>}``) and the learning rate read
  from a Keras SGD optimizer, as ``ea.State`` attaches it; also with Python floats as metrics
  (Keras' logs, ``lr`` among them: no tensor read); a flush is never due meanwhile;
* ``flush``: one write of the points rank 0 buffers in ``FLUSH_SECONDS`` at
  ``--steps-per-second`` and the event file's flush; rank 0's first marker, which creates the
  file and traces the write function, is reported apart (once per process).

Prints one JSON object: seconds of CPU (and wall) per call, and the event file's bytes per
point written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tensorflow as tf

from elastic_allreduce.training import tensorboard


def _event_bytes(directory: Path) -> int:
    """Bytes of the event files under ``directory``."""
    return sum(path.stat().st_size for path in directory.rglob("events.out.tfevents.*"))


def main() -> None:
    """Time the listener and the flush; print the figures as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--flushes", type=int, default=20)
    parser.add_argument("--steps-per-second", type=float, default=65.0)
    parser.add_argument("--batch", type=int, default=128, help="global samples per step")
    args = parser.parse_args()
    steps_per_flush = max(1, round(args.steps_per_second * tensorboard.FLUSH_SECONDS))

    optimizer = tf.keras.optimizers.SGD(0.001)
    loss = tf.constant(0.25)
    metrics = {"loss": loss}
    with tempfile.TemporaryDirectory(prefix="bench-summaries-") as folder:
        directory = Path(folder) / tensorboard.SUBDIRECTORY
        # A flush is never due by itself: this probe calls flush() when it wants one.
        summaries = tensorboard.RankZeroSummaries(
            directory,
            learning_rate=tensorboard.learning_rate_of(optimizer),
            flush_seconds=1e9,
        )
        # Rank 0's first marker: creates the event file, traces the batch writer, writes the
        # marker (once per process, then at each ring change).
        cpu, wall = time.process_time(), time.perf_counter()
        summaries.ring(rank=0, size=2, epoch=0, step=0, cause=None)
        first_cpu, first_wall = time.process_time() - cpu, time.perf_counter() - wall
        step = 0
        for _ in range(steps_per_flush):  # a warm-up flush
            step += 1
            summaries.on_step(step, 0.015, args.batch, metrics)
        summaries.flush()

        def per_call(step_metrics: dict[str, Any]) -> float:
            """CPU seconds of one on_step call with ``step_metrics`` (median of 5 rounds; the
            buffered points are dropped between rounds, never written)."""
            nonlocal step
            rounds: list[float] = []
            for _ in range(5):
                cpu = time.process_time()
                for _ in range(args.calls // 5):
                    step += 1
                    summaries.on_step(step, 0.015, args.batch, step_metrics)
                rounds.append((time.process_time() - cpu) / (args.calls // 5))
                summaries._tags, summaries._steps, summaries._values = [], [], []
            return statistics.median(rounds)

        # As hvd_steps.py --summaries (a custom loop): the loss tensor, the learning rate read
        # from the optimizer; as the Keras feed: Python floats, Keras' "lr" among them.
        on_step = per_call(metrics)
        on_step_floats = per_call({"loss": 0.25, "lr": 0.001})

        # A flush of one FLUSH_SECONDS' worth of points.
        flush_cpu: list[float] = []
        flush_wall: list[float] = []
        bytes_before = _event_bytes(directory)
        points = 0
        for _ in range(args.flushes):
            for _ in range(steps_per_flush):
                step += 1
                summaries.on_step(step, 0.015, args.batch, metrics)
            points += len(summaries._tags)
            cpu, wall = time.process_time(), time.perf_counter()
            summaries.flush()
            flush_cpu.append(time.process_time() - cpu)
            flush_wall.append(time.perf_counter() - wall)
        written = _event_bytes(directory) - bytes_before
        summaries.close()
    print(
        json.dumps(
            {
                "on_step_cpu_s": on_step,
                "on_step_floats_cpu_s": on_step_floats,
                "flush_seconds": tensorboard.FLUSH_SECONDS,
                "steps_per_flush": steps_per_flush,
                "points_per_flush": points / args.flushes,
                "flush_cpu_s": statistics.median(flush_cpu),
                "flush_wall_s": statistics.median(flush_wall),
                "first_write_cpu_s": first_cpu,
                "first_write_wall_s": first_wall,
                "bytes_per_point": written / points if points else None,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
