"""The checkpoint folder of one job: durable writes, the last K kept, loading with fallback.

Rank 0 of ``elastic_allreduce.State`` writes every ``checkpoint_every``-th commit here; every
new State reads the newest usable one back. Layout, under ``--checkpoint-dir`` (``root``)::

    <root>/<job-id>/                      one job's folder (``default`` without a job id)
        ckpt-00000007-commit-000000140/   the 7th checkpoint written, of commit 140
            arrays.npz                    the model's then the optimizer's variables, in order
            meta.json                     job id, fingerprint, commit id, attributes, sizes
        LATEST                            the newest one's name, for people and tools
        .staging-*                        a write in progress (or a crashed writer's leftover)

A write stages the files in a fresh ``.staging-*`` folder, fsyncs each file and the folder,
renames the folder into place and fsyncs the job folder; only then does it update ``LATEST``
(written to a temporary file, fsynced and renamed) and delete all but the newest K
checkpoints. A power loss at any point leaves complete checkpoints only, plus perhaps a staging
leftover, which the next writer removes. Any ``OSError`` (a full disk, a read-only mount)
skips that checkpoint with a warning and removes its staging folder: training goes on.

Loading tries the checkpoints newest first (by the sequence number in their names; ``LATEST``
is not needed) and skips, with a warning saying which and why, one that is unreadable or
truncated, belongs to another job, or was written for another state (its fingerprint: the
variables' names, shapes and dtypes and the attributes' names differ). Only this job's folder
is ever read, written or pruned, so jobs that share ``root`` never touch each other's files.

No TensorFlow here: arrays are NumPy arrays, attributes JSON values.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt

from elastic_allreduce import progress
from elastic_allreduce.agreement import VariableSpec
from elastic_allreduce.errors import CheckpointError, ConfigError
from elastic_allreduce.records.values import DEFAULT_KEEP_CHECKPOINTS

log = logging.getLogger(__name__)

#: The job folder's name when no job id is set (a script run by hand, outside elastic-run).
DEFAULT_JOB: Final = "default"
#: The version of the files' layout, in meta.json.
FORMAT: Final = 1
LATEST: Final = "LATEST"
ARRAYS: Final = "arrays.npz"
META: Final = "meta.json"
STAGING_PREFIX: Final = ".staging-"
_NAME = re.compile(r"^ckpt-(?P<sequence>\d{8,})-commit-(?P<commit>\d+)$")


def fingerprint(variables: Iterable[VariableSpec], attribute_names: Iterable[str]) -> str:
    """A short hash of the state's shape: every variable's name, shape and dtype in order, and
    the attributes' names (``commit_id`` aside). Two states with the same fingerprint can load
    each other's checkpoints."""
    shape = {
        "variables": [[v.name, list(v.shape), v.dtype] for v in variables],
        "attributes": sorted(name for name in attribute_names if name != "commit_id"),
    }
    encoded = json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder of a job; ``sequence`` orders them (higher: written later)."""

    path: Path
    sequence: int
    commit_id: int


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back whole."""

    checkpoint: Checkpoint
    arrays: list[npt.NDArray[Any]]
    attributes: dict[str, Any]


class CheckpointDir:
    """The checkpoint folder ``<root>/<job-id>/`` of one job (see the module docstring).

    Only one process may write at a time (rank 0 of the ring); any process may load. Nothing
    here raises an OSError: writes that fail are skipped with a warning and loads skip the
    checkpoints they cannot read.
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
        self.full_hint = "free some, or lower --keep-checkpoints"

    @classmethod
    def at(
        cls,
        folder: str | os.PathLike[str],
        job_id: str | None,
        keep: int,
        *,
        kind: str,
        full_hint: str,
    ) -> CheckpointDir:
        """The same machinery in ``folder`` itself (not ``<folder>/<job-id>``), for folders that
        are the job's already (a slot's snapshot folder); the job id is still checked."""
        checkpoints = cls(folder, job_id, keep)
        checkpoints.path = Path(folder)
        checkpoints.kind = kind
        checkpoints.full_hint = full_hint
        return checkpoints

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

    def load(self, expected_fingerprint: str) -> Loaded | None:
        """The newest usable checkpoint, or None. Each one skipped is logged with the reason
        (unreadable, truncated, another job's, another state's)."""
        candidates = self.checkpoints()
        for checkpoint in candidates:
            try:
                return self._read(checkpoint, expected_fingerprint)
            except CheckpointError as exc:
                log.warning(
                    "skipping %s %s (commit %d): %s; trying the previous one",
                    self.kind,
                    checkpoint.path,
                    checkpoint.commit_id,
                    exc,
                )
        if candidates:
            log.warning(
                "none of the %d %ss in %s could be loaded (see above): starting from "
                "the initial state",
                len(candidates),
                self.kind,
                self.path,
            )
        return None

    def _read(self, checkpoint: Checkpoint, expected_fingerprint: str) -> Loaded:
        folder = checkpoint.path
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"its {META} is unreadable or truncated ({exc})") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"its {META} is not of format {FORMAT}")
        if meta.get("job_id") != self.job_id:
            raise CheckpointError(
                f"it belongs to job {meta.get('job_id')!r}, not to this job {self.job_id!r}"
            )
        attributes = meta.get("attributes")
        if not isinstance(attributes, dict):
            raise CheckpointError(f"its {META} holds no attributes")
        if meta.get("fingerprint") != expected_fingerprint:
            raise CheckpointError(
                f"it was written for another state: fingerprint {meta.get('fingerprint')} "
                f"({meta.get('variables')} variables, attributes {sorted(attributes)}), "
                f"this state's is {expected_fingerprint}; not loading it (a different model or "
                "optimizer, or other State attributes)"
            )
        arrays_path = folder / ARRAYS
        try:
            size = arrays_path.stat().st_size
            if size != meta.get("arrays_bytes"):
                raise CheckpointError(
                    f"{ARRAYS} is truncated or damaged: {size} bytes, "
                    f"{meta.get('arrays_bytes')} written"
                )
            with np.load(arrays_path, allow_pickle=False) as stored:
                # Reading each member in full checks its CRC-32.
                arrays = [stored[f"a{i}"] for i in range(len(stored.files))]
        except CheckpointError:
            raise
        except Exception as exc:  # zipfile and NumPy raise many types for a damaged file
            raise CheckpointError(f"{ARRAYS} is unreadable ({type(exc).__name__}: {exc})") from exc
        if len(arrays) != meta.get("variables"):
            raise CheckpointError(
                f"{ARRAYS} holds {len(arrays)} arrays, {meta.get('variables')} written"
            )
        return Loaded(checkpoint, arrays, attributes)

    # -- writing ---------------------------------------------------------------------------

    def prepare(self) -> bool:
        """Before the first write (a new rank 0): create the job folder and remove staging
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
                "the checkpoint folder %s is not writable (%s): checkpoints will be skipped "
                "until it is",
                self.path,
                _reason(exc),
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

    def write(
        self,
        commit_id: int,
        arrays: Sequence[npt.ArrayLike],
        attributes: Mapping[str, Any],
        state_fingerprint: str,
    ) -> Checkpoint | None:
        """Write one checkpoint durably, then keep only the newest K. Returns it, or None when
        it was skipped (any OSError: a warning says why; the staging folder is removed).

        Raises ConfigError (before touching the disk) if the attributes are not JSON values.
        """
        meta: dict[str, Any] = {
            "format": FORMAT,
            "job_id": self.job_id,
            "fingerprint": state_fingerprint,
            "commit_id": commit_id,
            "variables": len(arrays),
            "attributes": dict(attributes),
            "written_at": time.time(),
        }
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"cannot checkpoint the state's attributes {sorted(attributes)}: {exc}; "
                "keep them JSON values (numbers, strings, lists, dicts)"
            ) from exc
        staging: Path | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))
            self.clean_staging(keep=staging)
            meta["arrays_bytes"] = _write_file(staging / ARRAYS, lambda f: _save_arrays(f, arrays))
            _write_file(staging / META, lambda f: f.write(json.dumps(meta).encode()))
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
            if self.kind == "checkpoint":
                progress.report_checkpoint_skipped(f"commit {commit_id} in {self.path}: {reason}")
            return None
        written = Checkpoint(final, sequence, commit_id)
        try:
            self._point_to(final.name)
        except OSError as exc:
            log.warning(
                "checkpoint %s is written but %s could not be updated: %s (loading does not "
                "need it)",
                final,
                LATEST,
                _reason(exc),
            )
        self.prune()
        return written

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


def _save_arrays(file: IO[bytes], arrays: Sequence[npt.ArrayLike]) -> None:
    """The arrays as ``a0``, ``a1``, ... in NumPy's .npz layout (``np.load`` reads it); unlike
    ``np.savez`` the archive is closed even when a write fails (a full disk)."""
    write_array: Callable[..., None] = np.lib.format.write_array  # untyped in NumPy's stubs
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for index, value in enumerate(arrays):
            with archive.open(f"a{index}.npy", "w", force_zip64=True) as member:
                write_array(member, np.asanyarray(value), allow_pickle=False)


def _remove(path: Path) -> None:
    """Delete a folder (or file) of this job; a failure is logged, not raised."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except OSError as exc:
        log.warning("could not delete %s: %s", path, _reason(exc))


def _reason(exc: OSError, full_hint: str = "free some, or lower --keep-checkpoints") -> str:
    """An OSError as a reason, with what to do about a full disk."""
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device ({exc}); {full_hint}"
    return str(exc)
