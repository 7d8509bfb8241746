"""Snapshots outside the process: each slot's last commit in shared memory, owned by its agent.

Under ``elastic-run`` the agent gives every slot a folder of its own in shared memory,
``<root>/<job-id>/<slot>/`` (root: ``/dev/shm/elastic-allreduce-<uid>``, or
``ELASTIC_ALLREDUCE_SNAPSHOT_ROOT``; mode 0700, this user's: /dev/shm is shared by every user,
so a root someone else owns or a symlink is refused), and passes its path to the process in
``ELASTIC_ALLREDUCE_SNAPSHOT_DIR``. ``elastic_allreduce.State``, and Horovod's own
``TensorFlowKerasState`` under elastic-run (:mod:`elastic_allreduce.bootstrap.hooks`), write each
commit
there (the checkpoint layout, keeping one; :mod:`elastic_allreduce.commits.snapshots`) and a new
process loads it: a process restarted on the same node, or a whole ring that died while its
agents lived, resumes from its last commit in memory. The
folder outlives the process, not the agent: the agent removes its slots' folders when it exits
(the node left, the job ended, or it stopped).

Shared memory is often small (a container's ``/dev/shm`` is 64 MiB by default): the agent logs
what is free when it starts, and a State skips a snapshot that would not fit, warning once with
what to raise. Stdlib only, so the agent imports no NumPy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

#: Where agents put their slots' snapshot folders unless ELASTIC_ALLREDUCE_SNAPSHOT_ROOT says:
#: one root per user, whose ownership is checked (check_root).
DEFAULT_ROOT: Final = f"/dev/shm/elastic-allreduce-{os.getuid()}"  # noqa: S108 - checked
#: ELASTIC_ALLREDUCE_SNAPSHOT_ROOT's value that turns snapshots off.
OFF: Final = "off"
#: What to raise when shared memory is too small, for the warnings.
RAISE_HINT: Final = (
    "raise the shared memory size (docker run --shm-size, a Kubernetes emptyDir with medium: "
    "Memory and a larger sizeLimit mounted at /dev/shm)"
)
#: Below this much free shared memory at start the agent warns (a 1 M-parameter Adam state is
#: 12 MB, and a snapshot needs room for two while the new one is written).
LOW_SPACE: Final = 256 * 2**20
#: Room for meta.json and the archive's headers, on top of the arrays.
OVERHEAD: Final = 1 * 2**20

StatVfs = Callable[[str], os.statvfs_result]


def job_folder(root: str | os.PathLike[str], job_id: str) -> Path:
    """``<root>/<job-id>``: the job's snapshot folders on this machine."""
    return Path(root) / job_id


def free_bytes(path: str | os.PathLike[str], statvfs: StatVfs = os.statvfs) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system (None: unknown)."""
    try:
        result = statvfs(os.fspath(path))
    except OSError:
        return None
    return result.f_bavail * result.f_frsize


def fits(needed: int, path: str | os.PathLike[str], statvfs: StatVfs = os.statvfs) -> bool:
    """Whether a snapshot of ``needed`` bytes (arrays) fits on ``path``'s file system now."""
    free = free_bytes(path, statvfs)
    return free is None or needed + OVERHEAD <= free


def check_root(root: str | os.PathLike[str], statvfs: StatVfs = os.statvfs) -> bool:
    """The agent, at start: create the root (mode 0700 for what it creates) and log how much
    shared memory is free, warning when it is little. False (with a warning) when the root is
    unusable: the node's processes then get no snapshot folder."""
    try:
        Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
        info = Path(root).lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            log.warning("snapshots in shared memory are off: %s is not this user's folder", root)
            return False
        Path(root).chmod(0o700)
    except OSError as exc:
        log.warning("snapshots in shared memory are off: cannot create %s (%s)", root, exc)
        return False
    free = free_bytes(root, statvfs)
    if free is not None and free < LOW_SPACE:
        log.warning(
            "only %.1f MiB of shared memory free at %s: a state larger than about %.1f MiB "
            "(weights and optimizer slots, per process) gets no snapshot; %s",
            free / 2**20,
            root,
            max(0, free - OVERHEAD) / 2 / 2**20,
            RAISE_HINT,
        )
    return True


def prepare_slot(root: str | os.PathLike[str], job_id: str, slot: str) -> Path | None:
    """Create (or reuse) the slot's folder, mode 0700 and owned by this user; None, with a
    warning, when that fails (the process then runs without snapshots)."""
    folder = job_folder(root, job_id) / slot
    try:
        folder.parent.mkdir(mode=0o700, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            log.warning("snapshots off for slot %s: %s is not this user's folder", slot, folder)
            return None
        folder.chmod(0o700)
    except OSError as exc:
        log.warning("snapshots off for slot %s: cannot create %s (%s)", slot, folder, exc)
        return None
    return folder


def remove_slots(root: str | os.PathLike[str], job_id: str, slots: Iterable[str]) -> None:
    """Delete the slots' folders, then the job's folder if no other agent's remain in it."""
    job = job_folder(root, job_id)
    for slot in slots:
        folder = job / slot
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        job.rmdir()  # fails while another agent of this job on this machine has slots
