"""Benchmark workload: what elastic_allreduce.State costs for models of several sizes.

Runs under `elastic-run`. For each size in --params, a dense model (Adam, so the state is the
weights and two moment slots) trains for --steps steps, committing every --commit-every steps,
then commits --extra-commits more times with each part of a commit timed alone. Rank 0 prints:

* {"event": "sync", ...}: State.sync() -- the broadcast of the committed state that a joiner
  receives -- timed after a barrier; the first one for each model runs on a ring that has not
  moved that model's tensors yet (what a joiner sees), the others repeat it;
* {"event": "summary", ...}: per model, step and commit times (medians), the parts of a commit
  (the in-memory save, rank 0's progress report to etcd, the host-update check), state bytes,
  and the medians of --store-rounds rounds, each after a barrier, of what keeping the commit
  outside the process costs: a commit with the slot's shared-memory snapshot off (the State's
  snapshot writer detached for it) and on (the writer idle when it starts), the background
  write of that snapshot (handed to the writer thread -> written; every rank writes its own
  at once), ``CheckpointDir.write`` of the committed state to --checkpoint-root (a disk:
  rank 0 alone, as in training), and rank 0 alone loading the commit back into the model with
  ``state_snapshots.load_newest`` from the snapshot, and from the checkpoint with its files
  first dropped from the page cache (cold) and again (warm). The broadcast a joiner receives
  is the sync above. A figure that could not be taken is None, with why in "store_problems".
  For models up to --stretch-max-params also "commit_mean_s": the mean commit time over a
  stretch of --stretch-steps training steps with host-update votes at every commit (as before
  they were batched) and with the default, batched votes -- timed where the loop commits, so a
  vote's wait for the slower rank counts, as it does in training.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from dense_workload import dense_model, train_step_fn

import elastic_allreduce as ea
from elastic_allreduce import env, keras_compat
from elastic_allreduce.commits import snapshots as state_snapshots
from elastic_allreduce.commits.checkpoint import CheckpointDir

parser = argparse.ArgumentParser()
parser.add_argument("--params", default="1000000", help="model sizes, comma-separated")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--commit-every", type=int, default=10)
parser.add_argument("--extra-commits", type=int, default=3)
parser.add_argument("--extra-syncs", type=int, default=2)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument(
    "--store-rounds", type=int, default=2, help="rounds of the snapshot/checkpoint/restore timings"
)
parser.add_argument(
    "--stretch-steps",
    type=int,
    default=60,
    help="steps of each commit-cost stretch (host-update votes at every commit, then batched)",
)
parser.add_argument(
    "--stretch-max-params",
    type=int,
    default=2_000_000,
    help="models up to this size get the commit-cost stretches (larger ones take too long)",
)
parser.add_argument(
    "--checkpoint-root", default=None, help="a folder on disk for the checkpoints (none: not timed)"
)
args = parser.parse_args()

#: The longest one snapshot write may take (600 MB on a loaded machine takes seconds).
SNAPSHOT_WAIT_S = 300.0

ea.init()
barrier_value = tf.constant(1.0)


def emit(record: dict[str, Any]) -> None:
    if ea.rank() == 0:
        print(json.dumps(record), flush=True)


def barrier() -> None:
    hvd.allreduce(barrier_value, name="bench.barrier", op=hvd.Sum)


def state_bytes(state: ea.State) -> int:
    variables = [*state.model.variables, *keras_compat.optimizer_variables(state.optimizer)]
    return int(sum(np.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables))


def timed(function: Callable[[], object]) -> float:
    barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def timed_rank0(function: Callable[[], Any] | None) -> tuple[float | None, Any]:
    """Seconds ``function`` takes on rank 0 alone after a barrier, and what it returned; the
    other ranks go on to the next barrier. (None, None) on them."""
    barrier()
    if ea.rank() != 0:
        return None, None
    assert function is not None, "rank 0 times a function"
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def drop_cached(folder: Path) -> None:
    """Evict the files under ``folder`` from the page cache (fsynced, so their pages are clean):
    the next read comes from the disk, as for a process on another machine."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def checkpoint_writer(state: ea.State, checkpoints: CheckpointDir) -> Callable[[], Any]:
    """A function writing ``state``'s last commit to ``checkpoints``, the arrays (views of the
    committed copies) and the fingerprint taken beforehand: only ``CheckpointDir.write`` is
    timed."""
    commit_id, attributes = state.commit_id, dict(state._saved_state)
    arrays = state_snapshots.committed_arrays(state)
    if arrays is None:
        raise RuntimeError(f"commit {commit_id} is incomplete: nothing to checkpoint")
    fingerprint = state_snapshots.state_fingerprint(state)
    return lambda: checkpoints.write(commit_id, arrays, attributes, fingerprint)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class TimedSnapshots(state_snapshots.SlotSnapshots):
    """The slot's snapshots, noting when the last commit was handed to the writer thread."""

    submitted_at: float | None = None

    def submit(
        self,
        state: ea.State,
        commit_id: int,
        attributes: dict[str, Any],
        checkpoint: state_snapshots.CheckpointPersister | None = None,
    ) -> None:
        self.submitted_at = time.perf_counter()
        super().submit(state, commit_id, attributes, checkpoint)


class TimedState(ea.State):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._commits.snapshots is not None:
            self._commits.snapshots = TimedSnapshots(self._commits.snapshots.folder)

    def sync(self) -> None:
        seconds = timed(super().sync)
        emit({"event": "sync", "seconds": seconds, "bytes": state_bytes(self), "size": ea.size()})


class StoreCosts:
    """The figures of --store-rounds rounds for one state (see the module docstring): each
    round commits twice (snapshot off, then on), writes a checkpoint and loads the commit back
    from each source; every rank takes part in every barrier, rank 0 alone reports."""

    RESTORES = ("snapshot", "checkpoint_cold", "checkpoint_warm")

    def __init__(self, state: ea.State) -> None:
        self.state = state
        self.snapshots = state._commits.snapshots
        self.checkpoints = None
        if args.checkpoint_root and ea.rank() == 0:
            job_id = os.environ.get(env.JOB_ID)
            self.checkpoints = CheckpointDir(args.checkpoint_root, job_id, keep=1)
        names = ("commit_off", "commit_on", "snapshot_write", "checkpoint_write", *self.RESTORES)
        self.times: dict[str, list[float]] = {name: [] for name in names}
        self.problems: list[str] = []
        if self.snapshots is None:
            self.problems.append(f"no snapshot folder ({env.SNAPSHOT_DIR} unset): not timed")
        if args.checkpoint_root is None:
            self.problems.append("no --checkpoint-root: checkpoints not timed")

    def run(self) -> dict[str, Any]:
        """All rounds; the medians (None where nothing was timed) and the problems met."""
        for _ in range(args.store_rounds):
            self._commits()
            if args.checkpoint_root is not None:
                self._checkpoint()
            if self.snapshots is not None:
                self._restore(self.snapshots.folder, "snapshot")
            if args.checkpoint_root is not None:
                self._restore(self.checkpoints, "checkpoint_cold")
                self._restore(self.checkpoints, "checkpoint_warm")
        if self.checkpoints is not None:
            shutil.rmtree(self.checkpoints.path, ignore_errors=True)  # its disk and page cache
        medians = {name: median_or_none(values) for name, values in self.times.items()}
        return {
            "commit_snapshots_off_s": medians["commit_off"],
            "commit_snapshots_on_s": medians["commit_on"],
            "snapshot_write_s": medians["snapshot_write"],
            "checkpoint_write_s": medians["checkpoint_write"],
            "restore_s": {name: medians[name] for name in self.RESTORES},
            "store_rounds": args.store_rounds,
            "store_problems": self.problems,
        }

    def _commits(self) -> None:
        """A commit with the snapshot writer detached, then one with it (idle at the start),
        and that snapshot's write: from the hand-off to the writer thread until written."""
        state, snapshots = self.state, self.snapshots
        state.wait_for_snapshot(SNAPSHOT_WAIT_S)  # no write of an earlier commit still running
        state._commits.snapshots = None
        try:
            self.times["commit_off"].append(timed(state.commit))
        finally:
            state._commits.snapshots = snapshots
        if snapshots is None:
            return
        self.times["commit_on"].append(timed(state.commit))
        written = state.wait_for_snapshot(SNAPSHOT_WAIT_S)
        done = time.perf_counter()
        newest = snapshots.folder.checkpoints()
        if written and newest and newest[0].commit_id == state.commit_id:
            self.times["snapshot_write"].append(done - snapshots.submitted_at)
        else:
            self.problems.append(f"the snapshot of commit {state.commit_id} was not written")

    def _checkpoint(self) -> None:
        """Rank 0 writes the last commit to the checkpoint folder, then drops it from the page
        cache (for the cold read)."""
        write = (
            None if self.checkpoints is None else checkpoint_writer(self.state, self.checkpoints)
        )
        seconds, checkpoint = timed_rank0(write)
        if seconds is None:
            return
        if checkpoint is None:
            self.problems.append(f"the checkpoint of commit {self.state.commit_id} was skipped")
        else:
            self.times["checkpoint_write"].append(seconds)
            drop_cached(checkpoint.path)

    def _restore(self, source: CheckpointDir | None, name: str) -> None:
        """Rank 0 loads the last commit from ``source`` into the model (and commits it)."""
        state = self.state
        seconds, resumed = timed_rank0(lambda: state_snapshots.load_newest(state, [source]))
        if seconds is None:
            return
        if resumed is None or resumed[0].checkpoint.commit_id != state.commit_id:
            self.problems.append(f"restore from {name}: commit {state.commit_id} not loaded")
        else:
            self.times[name].append(seconds)


def commit_stretch(state: ea.State, train_step: Callable[[], Any], interval: str | None) -> float:
    """The mean time of the commits of --stretch-steps steps (a commit every --commit-every),
    with ``interval`` as ELASTIC_ALLREDUCE_HOST_CHECK_INTERVAL (None: the default, batched
    votes; "0": a vote at every commit, as before they were batched). Every rank runs it at
    the same point with the same setting, and the vote after the switch agrees on it."""
    if interval is None:
        os.environ.pop(env.HOST_CHECK_INTERVAL, None)
    else:
        os.environ[env.HOST_CHECK_INTERVAL] = interval
    commits = []
    try:
        for _ in range(args.stretch_steps):
            train_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                commits.append(timed_in_loop(state.commit))
    finally:
        os.environ.pop(env.HOST_CHECK_INTERVAL, None)
    return statistics.fmean(commits)


def timed_in_loop(action: Callable[[], Any]) -> float:
    """Seconds ``action`` takes where a training loop calls it (no barrier before)."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(params: int) -> None:
    optimizer = tf.keras.optimizers.Adam(0.0001)
    model, features = dense_model(params, args.batch, ea.rank(), optimizer)
    train_step = train_step_fn(model, optimizer, features, ea.DistributedGradientTape)

    @ea.run
    def train(state: TimedState) -> None:
        steps: list[float] = []
        commits: list[float] = []
        while state.step < args.steps:
            start = time.perf_counter()
            train_step()
            steps.append(time.perf_counter() - start)
            state.step += 1
            if state.step % args.commit_every == 0:
                start = time.perf_counter()
                state.commit()
                commits.append(time.perf_counter() - start)
        parts: dict[str, list[float]] = {"save": [], "report": [], "check": []}
        for _ in range(args.extra_commits):
            commits.append(timed(state.commit))
            parts["save"].append(timed(state.save))
            # Only rank 0 reports; every rank enters the barrier of timed().
            parts["report"].append(timed(state._report if ea.rank() == 0 else lambda: None))
            parts["check"].append(timed(state.check_host_updates))
        # Every commit voting (as before the votes were batched), then the default; each after
        # a stretch that lets the vote clock measure the pace.
        commit_mean = None
        if params <= args.stretch_max_params:
            every_commit = commit_stretch(state, train_step, "0")
            commit_stretch(state, train_step, None)
            commit_mean = {
                "every_commit": every_commit,
                "batched": commit_stretch(state, train_step, None),
            }
        for _ in range(args.extra_syncs):
            state.sync()
        stored = StoreCosts(state).run()
        timed_steps = steps[2:] or steps  # the first steps trace the tf.function
        emit(
            {
                "event": "summary",
                "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
                "state_bytes": state_bytes(state),
                "size": ea.size(),
                "step_s": statistics.median(timed_steps),
                "commit_s": statistics.median(commits),
                "commit_s_max": max(commits),
                "commit_parts_s": {name: statistics.median(v) for name, v in parts.items()},
                # Means over a stretch of commits: votes at every commit, and batched.
                "commit_mean_s": commit_mean,
                "commits": len(commits),
                "steps": len(timed_steps),
                "commit_every": args.commit_every,
                **stored,
            }
        )

    train(TimedState(model, optimizer, step=0))


for size in (int(p) for p in args.params.split(",")):
    measure(size)
    gc.collect()
