"""The sample audit log and its checker: ``python -m elastic_allreduce.training.audit DIR``.

With ``ELASTIC_ALLREDUCE_SAMPLE_LOG=DIR`` every rank appends one JSON line per training step to
``DIR/<slot>.jsonl``, written and flushed before the step runs::

    {"ring": <ring epoch>, "epoch": <data epoch>, "step": <global step>, "rank": <rank>,
     "ids": [<sample ids of this rank's batch>]}

A rolled-back step runs again later under a higher ring epoch with the same global step number.
The checker keeps, for every (data epoch, global step), only the executions of the highest ring
epoch -- the applied step -- and reports per data epoch the ids that are missing or duplicated.
It exits 0 only when there are none.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from elastic_allreduce import env, runtime


class SampleLog:
    """Appends this rank's audit lines (one file per process), if the log is enabled."""

    def __init__(self, directory: str | None = None, name: str | None = None) -> None:
        directory = directory or os.environ.get(env.SAMPLE_LOG)
        self._file: IO[str] | None = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            name = name or runtime.contract().slot or f"pid{os.getpid()}"
            self._file = open(Path(directory) / f"{name}.jsonl", "a")  # noqa: SIM115 - kept open

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, ring: int, epoch: int, step: int, rank: int, ids: Iterable[int]) -> None:
        """Write and flush one line before the step runs."""
        if self._file is None:
            return
        ids = [int(i) for i in ids]
        line = {"ring": ring, "epoch": epoch, "step": step, "rank": rank, "ids": ids}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()


@dataclass(frozen=True)
class EpochReport:
    """What the applied steps of one data epoch covered."""

    epoch: int
    steps: int
    samples: int
    missing: tuple[int, ...]
    duplicated: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated


@dataclass(frozen=True)
class AppliedStep:
    """One step as it reached the final state: its last execution (the highest ring epoch that
    ran it; earlier ones were rolled back), with each rank's sample ids."""

    epoch: int
    step: int
    ring: int
    #: (rank, ids) of every rank of that execution, in rank order.
    shares: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def ids(self) -> tuple[int, ...]:
        """The step's global batch."""
        return tuple(i for _, ids in self.shares for i in ids)


def applied_steps(directory: str | Path) -> list[AppliedStep]:
    """The applied steps of the log files, in training order (data epoch, then step)."""
    executions = _executions(directory)
    applied = []
    for (epoch, step), by_ring in sorted(executions.items()):
        ring = max(by_ring)
        shares = tuple(sorted((rank, tuple(ids)) for rank, ids in by_ring[ring]))
        applied.append(AppliedStep(epoch, step, ring, shares))
    return applied


def _executions(
    directory: str | Path,
) -> dict[tuple[int, int], dict[int, list[tuple[int, list[int]]]]]:
    """Every execution of every (data epoch, step), by ring epoch: (rank, ids) per rank."""
    executions: dict[tuple[int, int], dict[int, list[tuple[int, list[int]]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for path in sorted(Path(directory).glob("*.jsonl")):
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
                key = (int(line["epoch"]), int(line["step"]))
                executions[key][int(line["ring"])].append((int(line["rank"]), list(line["ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(
                    f"{path}:{number}: not an audit line ({exc}): {raw[:120]}"
                ) from exc
    return executions


def check(directory: str | Path, num_samples: dict[int, int] | int) -> list[EpochReport]:
    """Reconstruct the applied steps from the log files and report every data epoch."""
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    steps: Counter[int] = Counter()
    for applied in applied_steps(directory):
        steps[applied.epoch] += 1
        per_epoch[applied.epoch].update(applied.ids)
    reports = []
    for epoch in sorted(per_epoch):
        counts = per_epoch[epoch]
        total = num_samples[epoch] if isinstance(num_samples, dict) else num_samples
        missing = tuple(i for i in range(total) if counts[i] == 0)
        duplicated = tuple(sorted(i for i, c in counts.items() if c > 1))
        reports.append(EpochReport(epoch, steps[epoch], sum(counts.values()), missing, duplicated))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    """Check an audit directory; print one verdict line per data epoch."""
    parser = argparse.ArgumentParser(
        prog="python -m elastic_allreduce.training.audit",
        description="Check that every sample was applied exactly once per data epoch.",
    )
    parser.add_argument("directory", help="the ELASTIC_ALLREDUCE_SAMPLE_LOG directory")
    parser.add_argument("--samples", type=int, required=True, help="samples in the dataset")
    parser.add_argument("--epochs", type=int, help="data epochs that must appear (default: any)")
    args = parser.parse_args(argv)
    reports = check(args.directory, args.samples)
    seen = {r.epoch for r in reports}
    ok = bool(reports) and all(r.ok for r in reports)
    for report in reports:
        verdict = "ok" if report.ok else "FAILED"
        print(
            f"epoch {report.epoch}: {report.steps} applied steps, {report.samples} samples, "
            f"{len(report.missing)} missing, {len(report.duplicated)} duplicated: {verdict}"
        )
    if args.epochs is not None and seen != set(range(args.epochs)):
        print(f"expected data epochs 0..{args.epochs - 1}, found {sorted(seen)}: FAILED")
        ok = False
    if not reports:
        print(f"no audit lines in {args.directory}: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
