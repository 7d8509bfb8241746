"""A CPU quota for one process (cgroup v1's CPU controller; root), as a noisy neighbour or a
throttled machine would impose: the straggler scenario of the bench and the straggler test."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

#: The cgroup (v1) CPU controller; root is a requirement of the suite (DESIGN.md).
CPU_CGROUPS: Final = Path("/sys/fs/cgroup/cpu")


def available() -> bool:
    """Whether a CPU quota can be set here."""
    return (CPU_CGROUPS / "cgroup.procs").is_file() and os.access(CPU_CGROUPS, os.W_OK)


@contextlib.contextmanager
def cpu_quota(pid: int, percent: int, *, name: str = "elastic-allreduce") -> Iterator[None]:
    """Hold process ``pid`` (all its threads) to ``percent`` % of one CPU while inside; the
    cgroup made for it is removed on the way out, whatever happened."""
    assert available(), f"no writable cgroup CPU controller at {CPU_CGROUPS}"
    group = CPU_CGROUPS / f"{name}-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(percent * 1000))
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for task in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                (CPU_CGROUPS / "cgroup.procs").write_text(task)
        group.rmdir()
