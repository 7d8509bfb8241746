"""The job seen from outside, as the soak judges it: every output line of its processes and
every audit line of its ranks (ELASTIC_ALLREDUCE_SAMPLE_LOG), each with the moment it reached the
soak, and the ring epochs the launchers announced; and the questions asked of them (is the ring
healthy, when did it step again after a fault)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.soak.settings import AUDIT_POLL_S, FRESH_S

_RING_RUNNING = re.compile(r"\bepoch (\d+) running with (\d+) ranks")
_RING_TAKEN = re.compile(r"took over ring epoch (\d+) \(running, (\d+) ranks")
_FINAL = re.compile(r"\bjob \S+ (succeeded|failed): ")


@dataclass(frozen=True)
class Step:
    """One audit line (ELASTIC_ALLREDUCE_SAMPLE_LOG): a rank about to run a step."""

    arrived: float
    slot: str
    ring: int
    epoch: int
    step: int
    rank: int


class Tracker:
    """Every output line of the job's processes and every audit line of its ranks, with the
    moment each reached the soak, and the ring epochs the launchers announced."""

    def __init__(self, audit_dir: Path, log: IO[str]) -> None:
        self.audit_dir = audit_dir
        self.log = log
        self.cond = threading.Condition()
        self.steps: list[Step] = []
        self.by_ring: dict[int, dict[int, list[float]]] = {}  # ring -> rank -> arrivals
        self.ring_slots: dict[int, set[str]] = {}
        self.rings: dict[int, int] = {}  # ring epoch -> ranks, as a launcher announced it
        self.ring_at: dict[int, float] = {}  # ... and when
        self.lines: dict[str, list[tuple[float, str]]] = {}
        self.max_epoch = -1
        self.final: str | None = None  # the leader's last word: "job J succeeded: ..."
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="audit", daemon=True)
        self._poller.start()

    def close(self) -> None:
        """Stop polling (after one last read)."""
        if not self._stop.is_set():
            self._stop.set()
            self._poller.join(timeout=5)
            self._read_audit()

    # -- inputs --------------------------------------------------------------------------------

    def follow(self, who: str, proc: subprocess.Popen[str]) -> None:
        """Read ``proc``'s output lines, as ``who``, in a thread of their own."""

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                self._line(who, raw.rstrip("\n"))
            self._line(who, f"(exited with {proc.wait()})")

        threading.Thread(target=pump, name=f"out-{who}", daemon=True).start()

    def _line(self, who: str, text: str) -> None:
        now = time.monotonic()
        match = final = None
        if who.startswith("launcher"):
            match = _RING_RUNNING.search(text) or _RING_TAKEN.search(text)
            final = _FINAL.search(text)
        with self.cond:
            self.lines.setdefault(who, []).append((now, text))
            if match is not None and int(match.group(1)) not in self.rings:
                self.rings[int(match.group(1))] = int(match.group(2))
                self.ring_at[int(match.group(1))] = now
            if final is not None and self.final is None:
                self.final = text
            self.log.write(f"{now:.3f} [{who}] {text}\n")
            self.cond.notify_all()

    def _poll(self) -> None:
        while not self._stop.wait(AUDIT_POLL_S):
            self._read_audit()

    def _read_audit(self) -> None:
        new: list[Step] = []
        now = time.monotonic()
        for path in sorted(self.audit_dir.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as file:
                    file.seek(offset)
                    chunk = file.read()
            except OSError:
                continue
            if not chunk:
                continue
            self._offsets[path] = offset + len(chunk)
            *complete, rest = (self._partial.pop(path, b"") + chunk).split(b"\n")
            if rest:
                self._partial[path] = rest
            for raw in complete:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    line = json.loads(raw)
                    fields = (int(line[k]) for k in ("ring", "epoch", "step", "rank"))
                    new.append(Step(now, path.stem, *fields))
        if not new:
            return
        with self.cond:
            for step in new:
                self.steps.append(step)
                self.by_ring.setdefault(step.ring, {}).setdefault(step.rank, []).append(now)
                self.ring_slots.setdefault(step.ring, set()).add(step.slot)
                self.max_epoch = max(self.max_epoch, step.epoch)
            self.cond.notify_all()

    # -- questions: call them under ``cond`` (``wait`` does) -----------------------------------

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Whether ``predicate`` (evaluated under the lock) came true within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.25))
            return True

    def saw(self, who: str, needle: str, after: float = 0.0) -> float | None:
        """When ``who`` first printed a line holding ``needle`` after ``after``."""
        for at, text in self.lines.get(who, []):
            if at >= after and needle in text:
                return at
        return None

    def latest_ring(self) -> int:
        return max(self.rings, default=0)

    def stepping_since(self, epoch: int, after: float) -> float | None:
        """When every rank of ring ``epoch`` had printed two audit lines after ``after``."""
        lines = self.by_ring.get(epoch, {})
        moments = []
        for rank in range(self.rings[epoch]):
            times = [t for t in lines.get(rank, []) if t >= after]
            if len(times) < 2:
                return None
            moments.append(times[1])
        return max(moments, default=None)

    def recovered(
        self, after: float, min_epoch: int, *, need: str | None = None, without: str | None = None
    ) -> float | None:
        """When the first ring from ``min_epoch`` on -- holding slot ``need``, not holding
        ``without`` -- had every rank stepping after ``after``; None if none has yet."""
        best = None
        for epoch in self.rings:
            slots = self.ring_slots.get(epoch, set())
            if epoch < min_epoch or (need is not None and need not in slots):
                continue
            if without is not None and without in slots:
                continue
            moment = self.stepping_since(epoch, after)
            if moment is not None and (best is None or moment < best):
                best = moment
        return best

    def healthy(self, min_ranks: int) -> bool:
        """Whether every rank of the newest ring steps now, and it has at least ``min_ranks``."""
        epoch = self.latest_ring()
        if self.rings.get(epoch, 0) < min_ranks:
            return False
        now = time.monotonic()
        lines = self.by_ring.get(epoch, {})
        return all(
            len(lines.get(rank, [])) >= 2 and now - lines[rank][-1] <= FRESH_S
            for rank in range(self.rings[epoch])
        )

    def ring_members(self) -> list[str]:
        """The slots of the newest ring (those that printed a step in it), sorted."""
        return sorted(self.ring_slots.get(self.latest_ring(), set()))

    def texts(self, prefix: str) -> list[str]:
        """Every line printed by the processes whose name starts with ``prefix``."""
        with self.cond:
            return [
                t for who, lines in self.lines.items() if who.startswith(prefix) for _, t in lines
            ]
