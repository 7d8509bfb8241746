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

import hashlib
import json
import logging
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import numpy.typing as npt

from elastic_allreduce import progress
from elastic_allreduce.agreement.shape import VariableSpec
from elastic_allreduce.commits.folder import (
    ARRAYS,
    DEFAULT_JOB,
    LATEST,
    META,
    STAGING_PREFIX,
    Checkpoint,
    CheckpointFolder,
    Skipped,
    _write_file,
    fsync_dir,
)
from elastic_allreduce.errors import CheckpointError, ConfigError

__all__ = [
    "ARRAYS",
    "DEFAULT_JOB",
    "FORMAT",
    "LATEST",
    "META",
    "STAGING_PREFIX",
    "Checkpoint",
    "CheckpointDir",
    "Loaded",
    "fingerprint",
    "fsync_dir",
]

log = logging.getLogger(__name__)

#: The version of the files' layout, in meta.json.
FORMAT: Final = 1


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
class Loaded:
    """A checkpoint read back whole."""

    checkpoint: Checkpoint
    arrays: list[npt.NDArray[Any]]
    attributes: dict[str, Any]


class CheckpointDir(CheckpointFolder):
    """The checkpoint folder ``<root>/<job-id>/`` of one job's state (see the module
    docstring): :class:`CheckpointFolder` plus the arrays and attributes of a state.

    Only one process may write at a time (rank 0 of the ring); any process may load. Nothing
    here raises an OSError: writes that fail are skipped with a warning and loads skip the
    checkpoints they cannot read.
    """

    # -- reading ---------------------------------------------------------------------------

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

    def write(
        self,
        commit_id: int,
        arrays: Sequence[npt.ArrayLike],
        attributes: Mapping[str, Any],
        state_fingerprint: str,
    ) -> Checkpoint | None:
        """Write one checkpoint durably, then keep only the newest K. Returns it, or None when
        it was skipped (any OSError: a warning says why; the staging folder is removed; a
        checkpoint's skip is also counted in the process's progress report).

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

        def fill(staging: Path) -> None:
            meta["arrays_bytes"] = _write_file(staging / ARRAYS, lambda f: _save_arrays(f, arrays))
            _write_file(staging / META, lambda f: f.write(json.dumps(meta).encode()))

        written = self.write_staged(commit_id, fill)
        if isinstance(written, Skipped):
            if self.kind == "checkpoint":
                progress.report_checkpoint_skipped(written.reason)
            return None
        return written


def _save_arrays(file: IO[bytes], arrays: Sequence[npt.ArrayLike]) -> None:
    """The arrays as ``a0``, ``a1``, ... in NumPy's .npz layout (``np.load`` reads it); unlike
    ``np.savez`` the archive is closed even when a write fails (a full disk)."""
    write_array: Callable[..., None] = np.lib.format.write_array  # untyped in NumPy's stubs
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for index, value in enumerate(arrays):
            with archive.open(f"a{index}.npy", "w", force_zip64=True) as member:
                write_array(member, np.asanyarray(value), allow_pickle=False)
