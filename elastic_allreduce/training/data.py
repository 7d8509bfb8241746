"""Exactly-once elastic sharding of an epoch: which samples each rank trains on, step by step.

Every epoch has one deterministic order of the sample ids, a permutation drawn from
``(seed, epoch)``. Global steps consume that order front to back: step ``k`` of an epoch takes
the next ``global_batch`` ids after the epoch's *position* and splits them into contiguous
shares, one per rank. The position is part of the committed state, so after any rollback or
resize the ids not yet covered by a committed step are split over whatever ranks exist now:
within an epoch every sample contributes to exactly one applied step, whatever the resizes.

The sources at the end give random access to samples by id: in-memory arrays, any indexable
record collection, and TFRecord shards. This module is pure (no TensorFlow);
:class:`elastic_allreduce.training.api.ElasticData` feeds it to ``tf.data``.
"""

from __future__ import annotations

import abc
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import numpy.typing as npt

from elastic_allreduce.errors import ConfigError


@dataclass(frozen=True)
class Share:
    """One rank's part of one global step."""

    epoch: int
    #: The epoch position (number of ids of the epoch consumed) before this step.
    position: int
    #: This rank's sample ids, in the epoch's order (may be empty at the end of an epoch).
    ids: npt.NDArray[np.int64]
    #: How many ids the whole step covers (all ranks); the gradient weight is len(ids)/global.
    global_size: int

    def gradient_scale(self, size: int) -> float:
        """Factor for this rank's *mean* gradient before an averaging allreduce over ``size``
        ranks, so that the result is the mean gradient over the whole global batch."""
        return size * len(self.ids) / self.global_size


@dataclass(frozen=True)
class EpochSharding:
    """The deterministic order of one epoch and how steps cut it into shares."""

    num_samples: int
    seed: int
    shuffle: bool = True
    drop_remainder: bool = False

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ConfigError(f"a dataset needs at least one sample, got {self.num_samples}")

    def order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The sample ids of ``epoch`` in training order (the same on every rank and run)."""
        ids = np.arange(self.num_samples, dtype=np.int64)
        if not self.shuffle:
            return ids
        return np.random.default_rng([self.seed, epoch]).permutation(ids)

    def steps_left(self, position: int, global_batch: int) -> int:
        """Global steps still to run in an epoch from ``position``."""
        remaining = self.num_samples - position
        if remaining <= 0:
            return 0
        full, partial = divmod(remaining, global_batch)
        return full + (1 if partial and not self.drop_remainder else 0)

    def share(
        self, epoch: int, position: int, global_batch: int, rank: int, size: int
    ) -> Share | None:
        """Rank ``rank``'s share of the step at ``position``; None when the epoch is done.

        The step covers ``min(global_batch, remaining)`` ids (none if only a partial batch is
        left and ``drop_remainder`` is set), split into ``size`` contiguous shares whose sizes
        differ by at most one, lower ranks taking the larger ones.
        """
        if global_batch < 1 or not 0 <= rank < size:
            raise ConfigError(
                f"bad share request: global batch {global_batch}, rank {rank} of {size}"
            )
        remaining = self.num_samples - position
        if remaining <= 0 or (self.drop_remainder and remaining < global_batch):
            return None
        count = min(global_batch, remaining)
        base, extra = divmod(count, size)
        start = position + rank * base + min(rank, extra)
        length = base + (1 if rank < extra else 0)
        return Share(epoch, position, self.order(epoch)[start : start + length], count)


def global_batch_for(policy: str, batch_per_rank: int, global_batch: int | None, size: int) -> int:
    """The global batch of a step: ``fixed`` keeps ``global_batch``; ``linear`` is b x size."""
    if policy == "fixed":
        if not global_batch or global_batch < 1:
            raise ConfigError("the fixed-global-batch policy needs global_batch >= 1")
        return global_batch
    if policy == "linear":
        if batch_per_rank < 1:
            raise ConfigError(f"batch_per_rank must be at least 1, got {batch_per_rank}")
        return batch_per_rank * size
    raise ConfigError(f"unknown batch policy {policy!r}: use 'fixed' or 'linear'")


# -- sources: where the samples of an epoch come from -------------------------------------------


class Source(abc.ABC):
    """Random access to a dataset's samples by id (``0 .. len - 1``), a batch at a time.

    ``fetch`` returns one batch as a tuple of NumPy arrays whose first axis is the batch (for
    example ``(features, labels)``); the ids may be in any order and the result follows it.
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many samples the dataset has."""

    @abc.abstractmethod
    def fetch(self, ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], ...]:
        """The samples ``ids`` as a batch."""


class ArraySource(Source):
    """In-memory arrays of equal length: sample ``i`` is ``tuple(a[i] for a in arrays)``."""

    def __init__(self, *arrays: npt.ArrayLike) -> None:
        self.arrays = tuple(np.asarray(array) for array in arrays)
        if not self.arrays:
            raise ConfigError("an ArraySource needs at least one array")
        lengths = {len(array) for array in self.arrays}
        if len(lengths) != 1:
            raise ConfigError(
                f"the arrays differ in length: {[len(a) for a in self.arrays]}; "
                "every array needs one entry per sample"
            )

    def __len__(self) -> int:
        return len(self.arrays[0])

    def fetch(self, ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], ...]:
        return tuple(array[ids] for array in self.arrays)


class SupportsRecords(Protocol):
    """What :class:`RecordSource` needs of a record collection."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> object: ...


class RecordSource(Source):
    """Any indexable record collection (``len(records)`` and ``records[i]``), e.g. a list of
    file paths wrapped in a loader, a memory-mapped file, or a database table.

    ``records[i]`` must return a tuple of array-likes of fixed shapes (``(features, label)``);
    a batch stacks each component. Only the fetched records are read.
    """

    def __init__(self, records: SupportsRecords) -> None:
        self.records = records
        count = len(records)
        if count < 1:
            raise ConfigError("the record source is empty: it needs at least one record")
        self._arity = len(self._record(0))

    def __len__(self) -> int:
        return len(self.records)

    def _record(self, index: int) -> tuple[object, ...]:
        record = self.records[index]
        if not isinstance(record, tuple) or not record:
            raise ConfigError(
                f"record {index} is a {type(record).__name__}, not a non-empty tuple: "
                "records[i] must return (features, label) or another tuple of arrays"
            )
        return record

    def fetch(self, ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], ...]:
        records = [self._record(int(i)) for i in ids]
        if not records:
            first = [np.asarray(part) for part in self._record(0)]
            return tuple(np.zeros((0, *part.shape), part.dtype) for part in first)
        if any(len(record) != self._arity for record in records):
            raise ConfigError(f"records differ in length; every record needs {self._arity} parts")
        return tuple(
            np.stack([np.asarray(record[k]) for record in records]) for k in range(self._arity)
        )


_TFRECORD_HEADER = struct.Struct("<QI")
_TFRECORD_FOOTER = 4


class TFRecordSource(Source):
    """Records of uncompressed TFRecord files (shards), addressed by id across all files.

    Opening indexes every record's byte offset by walking the length headers (the payloads are
    not read); with ``counts`` (the known record count of each file) a file whose count differs
    is refused. ``fetch`` returns a one-tuple of serialized records (an object array of bytes):
    parse them into ``(features, labels)`` with ``ElasticData.from_tfrecords(..., parse=fn)``.
    """

    def __init__(
        self, paths: Sequence[str | os.PathLike[str]], counts: Sequence[int] | None = None
    ) -> None:
        self.paths = [Path(path) for path in paths]
        if not self.paths:
            raise ConfigError("no TFRecord files given: pass at least one path")
        if counts is not None and len(counts) != len(self.paths):
            raise ConfigError(
                f"{len(counts)} record counts for {len(self.paths)} files: give one count per file"
            )
        offsets: list[npt.NDArray[np.int64]] = []
        for number, path in enumerate(self.paths):
            found = _index_tfrecord(path)
            if counts is not None and len(found) != counts[number]:
                raise ConfigError(
                    f"{path} holds {len(found)} records, not the {counts[number]} given: "
                    "fix the counts, or pass counts=None to take what the files hold"
                )
            offsets.append(found)
        self._file_of = np.concatenate(
            [np.full(len(found), number, np.int64) for number, found in enumerate(offsets)]
        )
        self._offset_of = np.concatenate(offsets)
        if len(self._offset_of) == 0:
            raise ConfigError(f"the TFRecord files {[str(p) for p in self.paths]} hold no records")
        self._files: dict[int, IO[bytes]] = {}

    def __len__(self) -> int:
        return len(self._offset_of)

    def fetch(self, ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], ...]:
        out = np.empty(len(ids), dtype=object)
        for position, index in enumerate(ids):
            number = int(self._file_of[index])
            handle = self._files.get(number)
            if handle is None:
                handle = self._files[number] = open(self.paths[number], "rb")  # noqa: SIM115
            handle.seek(int(self._offset_of[index]))
            length, _ = _TFRECORD_HEADER.unpack(handle.read(_TFRECORD_HEADER.size))
            out[position] = handle.read(length)
        return (out,)

    def close(self) -> None:
        """Close the open files (they are reopened on the next fetch)."""
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def _index_tfrecord(path: Path) -> npt.NDArray[np.int64]:
    """Byte offsets of the records of one uncompressed TFRecord file."""
    try:
        size = path.stat().st_size
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigError(f"cannot read TFRecord file {path}: {exc}") from exc
    offsets: list[int] = []
    with handle:
        position = 0
        while position < size:
            header = handle.read(_TFRECORD_HEADER.size)
            if len(header) < _TFRECORD_HEADER.size:
                break
            length, _ = _TFRECORD_HEADER.unpack(header)
            offsets.append(position)
            position += _TFRECORD_HEADER.size + length + _TFRECORD_FOOTER
            if position > size:
                break
            handle.seek(position)
    if position != size:
        raise ConfigError(
            f"{path} is not an uncompressed TFRecord file (its record headers do not add up to "
            f"its {size} bytes); compressed files cannot be read by id: write them uncompressed"
        )
    return np.asarray(offsets, dtype=np.int64)
