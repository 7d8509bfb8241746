"""A job's checkpoint folder as files: the layout, durable writes, the last K kept, copies in.

:mod:`elastic_allreduce.commits.checkpoint` builds on this to write and read a state's arrays; the
agent uses it alone to persist a slot's snapshot into the checkpoint folder
(:meth:`CheckpointFolder.copy_in`), so this module needs no NumPy. The layout and the write
protocol are described in :mod:`elastic_allreduce.commits.checkpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final, Self

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.records.values import DEFAULT_KEEP_CHECKPOINTS

log = logging.getLogger(__name__)

#: The job folder's name when no job id is set (a script run by hand, outside elastic-run).
DEFAULT_JOB: Final = "default"
LATEST: Final = "LATEST"
ARRAYS: Final = "arrays.npz"
META: Final = "meta.json"
STAGING_PREFIX: Final = ".staging-"
#: What a full device's warning advises for the checkpoint folder.
CHECKPOINT_FULL_HINT: Final = "free some, or lower --keep-checkpoints"
_NAME = re.compile(r"^ckpt-(?P<sequence>\d{8,})-commit-(?P<commit>\d+)$")
#: Tries of a copy whose source was replaced (a newer snapshot) while it was being opened.
_COPY_TRIES: Final = 3


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder of a job; ``sequence`` orders them (higher: written later)."""

    path: Path
    sequence: int
    commit_id: int


@dataclass(frozen=True)
class Skipped:
    """A write that did not happen, and why: ``attempted`` if it failed (a warning said so),
    not if there was nothing to write."""

    reason: str
    attempted: bool = True


class CheckpointFolder:
    """The folder ``<root>/<job-id>/`` of one job's checkpoints, as files.

    Only one process may write at a time (rank 0 of the ring, or the agent persisting its
    snapshot for it); any process may read. Nothing here raises an OSError: writes that fail
    are skipped with a warning, and unreadable folders list no checkpoints.
    """

    def __init__(
        self, root: str | os.PathLike[str], job_id: str | None, keep: int = DEFAULT_KEEP_CHECKPOINTS
    ) -> None:
        if keep < 1:
            raise ConfigError(f"keep_checkpoints must be at least 1, got {keep}")
        self.root = Path(root)
        self.job_id = job_id or DEFAULT_JOB
        self.path = self.root / self.job_id
        self.keep = keep
        #: What one is called in warnings, and what to do when the device is full.
        self.kind = "checkpoint"
        self.full_hint = CHECKPOINT_FULL_HINT

    @classmethod
    def at(
        cls,
        folder: str | os.PathLike[str],
        job_id: str | None,
        keep: int,
        *,
        kind: str,
        full_hint: str,
    ) -> Self:
        """The same machinery in ``folder`` itself (not ``<folder>/<job-id>``), for folders that
        are the job's already (a slot's snapshot folder); the job id is still checked."""
        found = cls(folder, job_id, keep)
        found.path = Path(folder)
        found.kind = kind
        found.full_hint = full_hint
        return found

    # -- reading ---------------------------------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        """This job's checkpoint folders, newest first (none if the folder is unreadable)."""
        found = []
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return []
        for entry in entries:
            match = _NAME.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append(
                    Checkpoint(Path(entry.path), int(match["sequence"]), int(match["commit"]))
                )
        return sorted(found, key=lambda c: c.sequence, reverse=True)

    # -- writing ---------------------------------------------------------------------------

    def prepare(self) -> bool:
        """Before the first write (a new writer): create the job folder and remove staging
        leftovers of writers that crashed. False, with a warning, if the folder is not
        writable (each write will then be skipped with a warning of its own)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))
            try:
                self.clean_staging(keep=probe)
            finally:
                shutil.rmtree(probe, ignore_errors=True)
        except OSError as exc:
            log.warning(
                "the %s folder %s is not writable (%s): %ss will be skipped until it is",
                self.kind,
                self.path,
                _reason(exc),
                self.kind,
            )
            return False
        return True

    def clean_staging(self, keep: Path) -> list[Path]:
        """Remove the staging folders older than ``keep`` (this writer's own): leftovers of
        writers that crashed. A younger one is left alone. Returns what was removed."""
        try:
            reference = keep.stat().st_mtime_ns
            entries = list(os.scandir(self.path))
        except OSError:
            return []
        removed = []
        for entry in entries:
            if not entry.name.startswith(STAGING_PREFIX) or entry.path == str(keep):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime_ns >= reference:
                    continue
            except OSError:
                continue
            _remove(Path(entry.path))
            removed.append(Path(entry.path))
        if removed:
            log.info("removed %d staging leftover(s) in %s", len(removed), self.path)
        return removed

    def write_staged(self, commit_id: int, fill: Callable[[Path], None]) -> Checkpoint | Skipped:
        """Write one checkpoint of ``commit_id`` durably: ``fill`` puts its files into a fresh
        staging folder (fsyncing each); the folder is fsynced and renamed into place, ``LATEST``
        updated and all but the newest K kept. An OSError anywhere skips it with a warning
        (the staging folder is removed) and returns why."""
        staging: Path | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))
            self.clean_staging(keep=staging)
            fill(staging)
            fsync_dir(staging)
            sequence = max((c.sequence for c in self.checkpoints()), default=0) + 1
            final = self.path / f"ckpt-{sequence:08d}-commit-{commit_id:09d}"
            os.rename(staging, final)
            staging = None
            fsync_dir(self.path)
        except OSError as exc:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            reason = _reason(exc, self.full_hint)
            log.warning(
                "skipped the %s of commit %d in %s: %s; training goes on, the previous "
                "%ss are kept",
                self.kind,
                commit_id,
                self.path,
                reason,
                self.kind,
            )
            return Skipped(f"commit {commit_id} in {self.path}: {reason}")
        try:
            self._point_to(final.name)
        except OSError as exc:
            log.warning(
                "%s %s is written but %s could not be updated: %s (loading does not need it)",
                self.kind,
                final,
                LATEST,
                _reason(exc),
            )
        self.prune()
        return Checkpoint(final, sequence, commit_id)

    def copy_in(self, source: CheckpointFolder) -> Checkpoint | Skipped:
        """Persist the newest checkpoint of ``source`` (a slot's snapshot folder) here, byte
        for byte and durably.

        ``source`` may replace its checkpoint meanwhile (it keeps one): both files are opened
        before anything is copied, and a checkpoint gone before that is retried with the one
        that replaced it. Its ``meta.json`` must name this job; the arrays are not read (the
        writer checked them, and a load checks their size and CRCs)."""
        for _ in range(_COPY_TRIES):
            stored = source.checkpoints()
            if not stored:
                return Skipped(f"no {source.kind} in {source.path}", attempted=False)
            newest = stored[0]
            try:
                meta_file = open(newest.path / META, "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                continue
            with meta_file:
                try:
                    arrays_file = open(newest.path / ARRAYS, "rb")  # noqa: SIM115
                except FileNotFoundError:
                    continue
                with arrays_file:
                    return self._copy_files(newest.commit_id, meta_file, arrays_file)
        return Skipped(f"the {source.kind}s in {source.path} kept changing", attempted=False)

    def _copy_files(
        self, commit_id: int, meta: IO[bytes], arrays: IO[bytes]
    ) -> Checkpoint | Skipped:
        """Stage copies of one checkpoint's open files and commit them (see copy_in)."""
        meta_bytes = meta.read()
        try:
            job_id = json.loads(meta_bytes).get("job_id")
        except (ValueError, AttributeError):
            job_id = None
        if job_id != self.job_id:
            log.warning(
                "not persisting commit %d: its %s names job %r, not this job %r",
                commit_id,
                META,
                job_id,
                self.job_id,
            )
            return Skipped(f"commit {commit_id}: its {META} names job {job_id!r}", False)

        def fill(staging: Path) -> None:
            _write_file(staging / ARRAYS, lambda f: _copy_bytes(arrays, f))
            _write_file(staging / META, lambda f: f.write(meta_bytes))

        return self.write_staged(commit_id, fill)

    def _point_to(self, name: str) -> None:
        """Make ``LATEST`` name ``name``, atomically and durably."""
        temporary = self.path / f"{STAGING_PREFIX}{LATEST}"
        try:
            _write_file(temporary, lambda f: f.write(f"{name}\n".encode()), exclusive=False)
            os.replace(temporary, self.path / LATEST)
        except OSError:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        fsync_dir(self.path)

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints of this job; returns what went."""
        removed = []
        for old in self.checkpoints()[self.keep :]:
            _remove(old.path)
            removed.append(old.path)
        return removed


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Callable[[IO[bytes]], object], *, exclusive: bool = True) -> int:
    """Create ``path``, fill it with ``write``, fsync it; returns its size in bytes."""
    with open(path, "xb" if exclusive else "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
        return file.tell()


def _copy_bytes(source: IO[bytes], target: IO[bytes]) -> None:
    """All of ``source`` into ``target``, in the kernel where it can (sendfile)."""
    target.flush()
    offset = 0
    size = os.fstat(source.fileno()).st_size
    try:
        while offset < size:
            sent = os.sendfile(target.fileno(), source.fileno(), offset, size - offset)
            if sent == 0:
                break
            offset += sent
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS) or offset:
            raise
        source.seek(0)
        shutil.copyfileobj(source, target, 2**20)
        return
    target.seek(offset)


def _remove(path: Path) -> None:
    """Delete a folder (or file) of this job; a failure is logged, not raised."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        log.warning("could not delete %s: %s", path, _reason(exc))


def _reason(exc: OSError, full_hint: str = CHECKPOINT_FULL_HINT) -> str:
    """An OSError as a reason, with what to do about a full disk."""
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device ({exc}); {full_hint}"
    return str(exc)
