"""Exactly-once elastic sharding of an epoch: which samples each rank trains on, step by step.

Every epoch has one deterministic order of the sample ids, a permutation drawn from
``(seed, epoch)``. Global steps consume that order front to back: step ``k`` of an epoch takes
the next ``global_batch`` ids after the epoch's *position* and splits them into contiguous
shares, one per rank. The position is part of the committed state, so after any rollback or
resize the ids not yet covered by a committed step are split over whatever ranks exist now:
within an epoch every sample contributes to exactly one applied step, whatever the resizes.

This module is pure (no TensorFlow); :mod:`elastic_allreduce.worker` feeds it to ``tf.data``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
