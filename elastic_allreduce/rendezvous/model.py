"""Ring epochs: which worker processes form the ring, and which Horovod ranks they get.

A *slot* is one training process of one node: ``"<node-id>.<index>"``. Horovod sees every slot
as a host of its own (``HOROVOD_HOSTNAME`` = the slot id, local rank 0, local size 1), so a slot
can fail, leave or join alone without disturbing its node's other processes. On GPU nodes each
slot sees only its own device (``CUDA_VISIBLE_DEVICES``), so local rank 0 is the right device.

A ring's rank order is the order of its ``slots``: survivors keep their relative order and new
slots are appended, so rank 0 is always the oldest survivor, whose committed state the others
receive.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from elastic_allreduce.errors import MalformedValueError
from elastic_allreduce.store.codec import JsonValue

_SLOT_RE: Final = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(\d+)$")


def slot_id(node_id: str, index: int) -> str:
    """The id of process ``index`` of node ``node_id``."""
    return f"{node_id}.{index}"


def split_slot(slot: str) -> tuple[str, int]:
    """``(node_id, index)`` of a slot id; ValueError when it is not one."""
    match = _SLOT_RE.match(slot)
    if not match:
        raise ValueError(f"not a slot id: {slot!r} (expected '<node-id>.<index>')")
    return match.group(1), int(match.group(3))


class RingState(enum.Enum):
    """Whether a ring epoch is waiting for its members or training."""

    #: Decided, but not every member has asked for its rank yet: nobody entered Gloo.
    FORMING = "forming"
    #: Every member received its rank; collectives of this epoch may run.
    RUNNING = "running"


@dataclass(frozen=True)
class SlotAssignment:
    """Horovod's view of one slot in one epoch (what ``rank_and_size`` answers)."""

    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1

    def horovod_response(self) -> bytes:
        """The body Horovod's elastic re-initialisation parses: six comma-separated ints."""
        values = (
            self.rank,
            self.size,
            self.local_rank,
            self.local_size,
            self.cross_rank,
            self.cross_size,
        )
        return ",".join(str(v) for v in values).encode("ascii")


#: Exit code of a training process that was not admitted to any epoch (not a crash).
NOT_ADMITTED_EXIT_CODE: Final = 75

#: What Horovod understands as "you are no longer part of the job" (the process then aborts).
REMOVED: Final = SlotAssignment(
    rank=-1, size=-1, local_rank=-1, local_size=-1, cross_rank=-1, cross_size=-1
)


@dataclass(frozen=True)
class Ring:
    """One ring epoch as stored at the job's ``ring`` key."""

    epoch: int
    slots: tuple[str, ...]
    state: RingState
    rendezvous: str
    #: Slots of a FORMING epoch that have not asked for their rank yet.
    waiting: tuple[str, ...] = field(default=())
    #: Why this epoch was formed: "start", "failure" (a member died or its collective failed)
    #: or "resize" (a member joined or left gracefully: members reset at their next commit).
    cause: str = "start"

    def assignment(self, slot: str) -> SlotAssignment:
        """The slot's ranks in this epoch; REMOVED when it is not a member."""
        if slot not in self.slots:
            return REMOVED
        rank = self.slots.index(slot)
        size = len(self.slots)
        return SlotAssignment(rank=rank, size=size, cross_rank=rank, cross_size=size)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The member nodes, in rank order of their first slot."""
        seen: dict[str, None] = {}
        for slot in self.slots:
            seen.setdefault(split_slot(slot)[0], None)
        return tuple(seen)

    def to_json(self) -> JsonValue:
        """The stored form (see docs/store.md)."""
        return {
            "epoch": self.epoch,
            "slots": list(self.slots),
            "state": self.state.value,
            "rendezvous": self.rendezvous,
            "waiting": list(self.waiting),
            "cause": self.cause,
        }

    @classmethod
    def from_json(cls, key: str, value: JsonValue) -> Ring:
        """Parse the stored form; MalformedValueError says what is wrong."""
        if not isinstance(value, dict):
            raise MalformedValueError(key, f"a ring must be an object, got {value!r}")
        try:
            epoch = value["epoch"]
            slots = value["slots"]
            waiting = value.get("waiting", [])
            rendezvous = value["rendezvous"]
            cause = value.get("cause", "start")
            state = RingState(value["state"])
        except (KeyError, ValueError) as exc:
            raise MalformedValueError(key, f"bad ring {value!r}: {exc}") from exc
        if (
            not isinstance(epoch, int)
            or not isinstance(rendezvous, str)
            or not isinstance(slots, list)
            or not isinstance(cause, str)
            or not isinstance(waiting, list)
            or not all(isinstance(s, str) for s in [*slots, *waiting])
        ):
            raise MalformedValueError(key, f"bad ring field types in {value!r}")
        return cls(
            epoch,
            tuple(str(s) for s in slots),
            state,
            rendezvous,
            tuple(str(s) for s in waiting),
            cause,
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
