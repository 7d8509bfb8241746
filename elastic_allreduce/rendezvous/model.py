"""Ring membership: which Horovod ranks a slot gets, and the member order of the next epoch.

A *slot* is one training process of one node: ``"<node-id>.<index>"`` (ids built and parsed in
:mod:`elastic_allreduce.records.keys`). Horovod sees every slot as a host of its own
(``HOROVOD_HOSTNAME`` = the slot id, local rank 0, local size 1), so a slot can fail, leave or
join alone without disturbing its node's other processes. On GPU nodes every slot sees all of
the node's GPUs (for NCCL's peer-to-peer transports) and computes on its own, which the agent
names by index and :mod:`elastic_allreduce.bootstrap.gpu` selects in TensorFlow; Horovod's local
rank
(always 0) picks nothing. The stored ring epoch is :class:`elastic_allreduce.records.values.Ring`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class SlotAssignment:
    """Horovod's view of one slot in one epoch (what ``rank_and_size`` answers)."""

    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        """The six ints in Horovod's order (rank, size, local, local size, cross, cross size)."""
        return (
            self.rank,
            self.size,
            self.local_rank,
            self.local_size,
            self.cross_rank,
            self.cross_size,
        )


#: What Horovod understands as "you are no longer part of the job" (the process then aborts).
REMOVED: Final = SlotAssignment(
    rank=-1, size=-1, local_rank=-1, local_size=-1, cross_rank=-1, cross_size=-1
)


def next_membership(
    current: Iterable[str], alive: Mapping[str, int], *, excluded: Iterable[str] = ()
) -> tuple[str, ...]:
    """The member order of the next epoch.

    ``current`` is the present ring order; ``alive`` maps every live slot to the store revision
    at which it registered. Survivors keep their order; newcomers follow, oldest first (ties by
    slot id), so rank 0 is the oldest survivor. ``excluded`` slots (leaving) are dropped.
    """
    dropped = set(excluded)
    survivors = [slot for slot in current if slot in alive and slot not in dropped]
    known = set(survivors)
    newcomers = sorted(
        (slot for slot in alive if slot not in known and slot not in dropped),
        key=lambda slot: (alive[slot], slot),
    )
    return (*survivors, *newcomers)
