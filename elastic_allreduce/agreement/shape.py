"""What the ranks of a ring epoch agree on before any state is broadcast (pure: no I/O).

Horovod matches collectives by name and waits, without limit, for every rank to submit the same
ones. A sync whose ranks hold differently shaped state therefore deadlocks silently: for example
survivors broadcast their optimizer's slot variables while a restarted process, whose Keras
optimizer has created none yet, already waits in the broadcast of the extra attributes.

So before a sync every rank describes its state -- names, shapes and dtypes of the model's and
the optimizer's variables, whether the optimizer has created its variables, the keys of the
extra attributes and the commit it holds -- and the ranks exchange these descriptions in one
allgather (:mod:`elastic_allreduce.agreement.sync` does the I/O). Every rank then reaches the same
verdict
from the same data: which rank is the sync root, which ranks must first create their
optimizer's variables, and the first difference that makes the sync impossible (one message,
raised on every rank at once).

The wire form is one line of JSON per rank, parsed field by field: nothing from a peer is
unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from elastic_allreduce.errors import ProtocolError

#: Version of the description's wire form; a rank that sends another one is refused.
VERSION: Final = 1
#: Ends each rank's description in the allgathered bytes (JSON text never contains it raw).
SEPARATOR: Final = b"\n"


@dataclass(frozen=True)
class VariableSpec:
    """One variable as the ranks compare it."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def describe(self) -> str:
        """``'dense/kernel:0' float32 (4, 1)``."""
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        if len(self.shape) == 1:
            dims += ","
        return f"{self.name!r} {self.dtype} ({dims})"


@dataclass(frozen=True)
class StateDescription:
    """One rank's training state, as far as a sync depends on it."""

    model: tuple[VariableSpec, ...]
    optimizer: tuple[VariableSpec, ...]
    #: Whether the optimizer has created its variables (Keras creates them at the first step).
    optimizer_built: bool
    extra_keys: tuple[str, ...]
    #: The commit this rank holds (``elastic_allreduce.State``); None for Horovod's own states.
    commit_id: int | None = None
    #: The rank's slot under `elastic-run` (named in messages), else None.
    slot: str | None = None

    def encode(self) -> bytes:
        """The wire form: one line of JSON, ended by :data:`SEPARATOR`."""
        payload = {
            "version": VERSION,
            "slot": self.slot,
            "commit_id": self.commit_id,
            "model": [_spec_json(spec) for spec in self.model],
            "optimizer": [_spec_json(spec) for spec in self.optimizer],
            "optimizer_built": self.optimizer_built,
            "extra_keys": list(self.extra_keys),
        }
        return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode() + SEPARATOR


def _spec_json(spec: VariableSpec) -> list[object]:
    return [spec.name, list(spec.shape), spec.dtype]


def decode_all(gathered: bytes, size: int) -> list[StateDescription]:
    """The ``size`` descriptions in rank order from the allgathered bytes; ProtocolError names
    the rank whose part is malformed."""
    parts = gathered.split(SEPARATOR)
    if len(parts) != size + 1 or parts[-1]:
        raise ProtocolError(
            f"state descriptions: expected {size} lines from {size} ranks, got {len(parts) - 1}"
        )
    return [_decode(part, rank) for rank, part in enumerate(parts[:-1])]


def _decode(raw: bytes, rank: int) -> StateDescription:
    where = f"rank {rank}'s state description"
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{where} is not UTF-8 JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} is not a JSON object")
    if value.get("version") != VERSION:
        raise ProtocolError(
            f"{where} has version {value.get('version')!r}, this rank reads {VERSION}: run the "
            "same elastic-allreduce release on every worker"
        )
    slot, commit, built = value.get("slot"), value.get("commit_id"), value.get("optimizer_built")
    extra = value.get("extra_keys")
    if slot is not None and not isinstance(slot, str):
        raise ProtocolError(f"{where}: slot must be a string or null")
    if commit is not None and (not isinstance(commit, int) or isinstance(commit, bool)):
        raise ProtocolError(f"{where}: commit_id must be an integer or null")
    if not isinstance(built, bool):
        raise ProtocolError(f"{where}: optimizer_built must be true or false")
    if not isinstance(extra, list) or not all(isinstance(k, str) for k in extra):
        raise ProtocolError(f"{where}: extra_keys must be a list of strings")
    return StateDescription(
        _specs(value.get("model"), f"{where}, model"),
        _specs(value.get("optimizer"), f"{where}, optimizer"),
        built,
        tuple(extra),
        commit,
        slot,
    )


def _specs(value: object, where: str) -> tuple[VariableSpec, ...]:
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected a list of variables")
    specs = []
    for item in value:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and isinstance(item[1], list)
            and all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in item[1])
            and isinstance(item[2], str)
        ):
            raise ProtocolError(f"{where}: {str(item)[:80]} is not [name, shape, dtype]")
        specs.append(VariableSpec(item[0], tuple(item[1]), item[2]))
    return tuple(specs)


# -- the verdict ------------------------------------------------------------------------------


def newest_commit_root(descriptions: Sequence[StateDescription]) -> int:
    """The lowest rank whose commit is the newest (ranks without a commit count as 0)."""
    commits = [d.commit_id or 0 for d in descriptions]
    return commits.index(max(commits))


def ranks_to_build(descriptions: Sequence[StateDescription]) -> list[int]:
    """Ranks whose optimizer must create its variables before the sync: those that have not,
    when any rank has (a restarted process joining survivors that already trained)."""
    if not any(d.optimizer_built for d in descriptions):
        return []
    return [rank for rank, d in enumerate(descriptions) if not d.optimizer_built]


def first_mismatch(descriptions: Sequence[StateDescription], root: int) -> str | None:
    """None when every rank's state has the root's shape; else one message naming the first
    rank that differs from the root and the first difference, with both sides."""
    reference = descriptions[root]
    for rank, description in enumerate(descriptions):
        if rank == root:
            continue
        difference = _difference(reference, description, root, rank)
        if difference is not None:
            return (
                f"cannot sync the training state: rank {rank}{_slot(description)} does not "
                f"match rank {root}{_slot(reference)}, the rank the state is synced from: "
                f"{difference}. Every rank must build the same model and optimizer (the same "
                "layers in the same order) and give the state the same extra attributes"
            )
    return None


def _slot(description: StateDescription) -> str:
    return f" (slot {description.slot})" if description.slot else ""


def _difference(
    reference: StateDescription, other: StateDescription, root: int, rank: int
) -> str | None:
    for what, mine, theirs in (
        ("model variable", reference.model, other.model),
        ("optimizer variable", reference.optimizer, other.optimizer),
    ):
        for index in range(max(len(mine), len(theirs))):
            left = mine[index] if index < len(mine) else None
            right = theirs[index] if index < len(theirs) else None
            if left != right:
                return (
                    f"{what} #{index} is {_spec_text(left)} on rank {root} but "
                    f"{_spec_text(right)} on rank {rank} ({len(mine)} vs {len(theirs)} "
                    f"{what}s)"
                )
    if reference.extra_keys != other.extra_keys:
        return (
            f"the extra state attributes are {list(reference.extra_keys)} on rank {root} but "
            f"{list(other.extra_keys)} on rank {rank}"
        )
    return None


def _spec_text(spec: VariableSpec | None) -> str:
    return "absent" if spec is None else spec.describe()
