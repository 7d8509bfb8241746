"""What the soak runs with: the job's shape, the fault kinds and every time limit, in one place
so that a replay (`make soak SEED=...`) is the same soak; and the three small helpers every part
uses (its progress lines, its error, polling for a state no output line shows)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from bench.jobs import ROOT

SCRIPT: Final = ROOT / "examples" / "cnn_digits.py"
RESULTS_DIR: Final = ROOT / "bench" / "results"
#: Worker hosts h2..h7: at most MAX_NODES hold a node, the others are free for joins.
WORKER_HOSTS: Final = 6
POOL: Final = 3  # nodes the pool is topped up to after each fault
MAX_NODES: Final = 4  # --max-workers
LEASE_TTL: Final = 3
#: Data epochs of the job per planned fault: the job must outlast the schedule (at 6.5 the
#: replay of seed 11734 ran out of epochs at fault 98: its faults fell behind the epochs).
EPOCHS_PER_FAULT: Final = 8
#: The share of the epochs the faults are spread over; the rest is slack for a schedule that
#: falls behind the epochs (each fault also waits for its recovery and the upkeep).
SPREAD: Final = 0.85
MIN_EPOCHS: Final = 20
#: Standbys started for a takeover fault before the soak gives up (one that took the job over
#: unasked, as etcd returned, is replaced).
STANDBY_TRIES: Final = 3
#: How long a fault that needs a training process of the newest ring waits for one.
VICTIM_LIMIT_S: Final = 60.0
GLOBAL_BATCH: Final = 64  # cnn_digits.py's default

KINDS: Final = (
    "kill",
    "stop",
    "leave",
    "join",
    "takeover",
    "adopt",
    "etcd_restart",
    "member_kill",
    "quorum_loss",
    "partition",
)
ETCD_KINDS: Final = frozenset({"etcd_restart", "member_kill", "quorum_loss"})

READY_LIMIT_S: Final = 300.0  # the first nodes import TensorFlow cold, all at once
HEALTH_LIMIT_S: Final = 300.0  # before a fault: the ring back at the ranks it needs
RECOVERY_LIMIT_S: Final = 180.0
JOIN_LIMIT_S: Final = 300.0  # a joining node imports TensorFlow cold on a busy machine
LAUNCHER_LIMIT_S: Final = 120.0
LEAVE_LIMIT_S: Final = 90.0  # the agent's own leave timeout is 60 s
ETCD_LIMIT_S: Final = 60.0
END_LIMIT_S: Final = 1800.0  # the job's end after its last fault
HANG_KILL_LIMIT_S: Final = 10.0  # a stopped process is killed by its agent after 0.5 s
FRESH_S: Final = 5.0  # a rank whose last audit line is older does not step
AUDIT_POLL_S: Final = 0.05
POLL_S: Final = 0.1
#: A cut host must have stopped its training processes by then (2 x TTL + 2 s, as tested).
FENCE_LIMIT_S: Final = 2 * LEASE_TTL + 2.0
#: The agents' snapshot folders (ELASTIC_ALLREDUCE_SNAPSHOT_ROOT, shared memory): one root for
#: the soak's jobs, removed at the end (an agent removes its own folders only when it exits).
SNAPSHOT_ROOT: Final = Path(f"/dev/shm/elastic-allreduce-soak-{os.getpid()}")  # noqa: S108


def say(message: str) -> None:
    """One line of the soak's own progress, on stdout."""
    print(f"[soak {datetime.now(UTC):%H:%M:%S}] {message}", flush=True)


class SoakError(RuntimeError):
    """The soak cannot go on: the job did not come back, ended early or failed."""


def poll_until(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``predicate()`` held (checked every POLL_S), or None after ``timeout`` s:
    for states that no output line shows (processes, etcd members)."""
    started = time.monotonic()
    pause = threading.Event()
    while not predicate():
        if time.monotonic() - started >= timeout:
            return None
        pause.wait(POLL_S)
    return time.monotonic() - started
