"""Every key of a job's prefix in the store: the one place that builds and parses them.

A store is bound to one job (``/elastic-allreduce/<job-id>/``); these are the relative keys
under it. Each key holds one record type of :mod:`elastic_allreduce.records.values`:

=============================  =============================  ==================================
key                            record                         written by
=============================  =============================  ==================================
``launcher/leader``            :class:`LeaderRecord`          launcher, under its lease
``config/job``                 :class:`JobConfig`             launcher
``config/target``              :class:`ScaleTarget`           ``elastic-run scale``
``ring``                       :class:`Ring`                  launcher, compare-and-swap
``status/job``                 :class:`JobStatus`             launcher
``status/progress``            :class:`Progress`              rank 0 of ``elastic_allreduce.State``
``status/ranks``               :class:`RanksRecord`           launcher, every few seconds
``status/hang``                :class:`HangRecord`            launcher's hang watchdog
``members/<node>``             :class:`MemberRecord`          agent, under its lease
``procs/<slot>``               :class:`ProcRecord`            training process, under its lease
``exits/<slot>/<incarnation>`` :class:`ExitRecord`            agent
``directives/<node>``          :class:`Directive`             launcher
=============================  =============================  ==================================

Pure: no I/O. A key that fits none of these shapes raises :class:`MalformedKeyError`, which
readers report and skip (a stray key never stops a job).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

from elastic_allreduce.errors import ConfigError, MalformedKeyError

#: Node ids: lowercase letters, digits and '-' (they are Kubernetes pod names); no dots, since a
#: slot id is ``<node-id>.<index>``.
NODE_ID_PATTERN: Final = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_NODE_RE: Final = re.compile(f"^{NODE_ID_PATTERN}$")
#: Job ids: a key segment of the store and part of Kubernetes names.
_JOB_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
_SLOT_RE: Final = re.compile(rf"^({NODE_ID_PATTERN})\.(0|[1-9][0-9]{{0,5}})$")
_INCARNATION_RE: Final = re.compile(r"^[1-9][0-9]{0,8}$")

LEADER: Final = "launcher/leader"
JOB_CONFIG: Final = "config/job"
SCALE_TARGET: Final = "config/target"
RING: Final = "ring"
JOB_STATUS: Final = "status/job"
PROGRESS: Final = "status/progress"
RANKS: Final = "status/ranks"
HANG: Final = "status/hang"
MEMBERS: Final = "members/"
PROCS: Final = "procs/"
EXITS: Final = "exits/"
DIRECTIVES: Final = "directives/"


class KeyKind(enum.Enum):
    """Which of the job's keys a key is."""

    LEADER = "leader"
    JOB_CONFIG = "job config"
    SCALE_TARGET = "scale target"
    RING = "ring"
    JOB_STATUS = "job status"
    PROGRESS = "progress"
    RANKS = "ranks"
    HANG = "hang"
    MEMBER = "member"
    PROC = "proc"
    EXIT = "exit"
    DIRECTIVE = "directive"


_SINGLE: Final = {
    LEADER: KeyKind.LEADER,
    JOB_CONFIG: KeyKind.JOB_CONFIG,
    SCALE_TARGET: KeyKind.SCALE_TARGET,
    RING: KeyKind.RING,
    JOB_STATUS: KeyKind.JOB_STATUS,
    PROGRESS: KeyKind.PROGRESS,
    RANKS: KeyKind.RANKS,
    HANG: KeyKind.HANG,
}


@dataclass(frozen=True)
class JobKey:
    """A parsed key: its kind and the node, slot and incarnation it names (where it has them)."""

    kind: KeyKind
    node: str | None = None
    slot: str | None = None
    incarnation: int | None = None


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it suits a key segment and a Kubernetes name, else raise ConfigError."""
    if not _JOB_RE.match(job_id):
        raise ConfigError(
            f"invalid job id {job_id!r}: use 1-40 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (for example 'mnist-1')"
        )
    return job_id


def validate_node_id(node_id: str) -> str:
    """Return ``node_id`` if it can name a node, else raise ConfigError saying the valid form."""
    if not _NODE_RE.match(node_id):
        raise ConfigError(
            f"invalid node id {node_id!r}: use 1-63 lowercase letters, digits and '-', starting "
            "and ending with a letter or digit (no dots: a slot id is '<node-id>.<index>')"
        )
    return node_id


def slot_id(node_id: str, index: int) -> str:
    """The id of process ``index`` of node ``node_id``."""
    return f"{node_id}.{index}"


def split_slot(slot: str) -> tuple[str, int]:
    """``(node_id, index)`` of a slot id; ValueError when it is not one."""
    match = _SLOT_RE.match(slot)
    if not match:
        raise ValueError(f"not a slot id: {slot!r} (expected '<node-id>.<index>')")
    return match.group(1), int(match.group(2))


def member(node_id: str) -> str:
    """``members/<node>``."""
    return MEMBERS + validate_node_id(node_id)


def directive(node_id: str) -> str:
    """``directives/<node>``."""
    return DIRECTIVES + validate_node_id(node_id)


def proc(slot: str) -> str:
    """``procs/<slot>``."""
    split_slot(slot)
    return PROCS + slot


def exit_(slot: str, incarnation: int) -> str:
    """``exits/<slot>/<incarnation>``."""
    split_slot(slot)
    if incarnation < 1:
        raise ValueError(f"incarnations start at 1, got {incarnation}")
    return f"{EXITS}{slot}/{incarnation}"


def parse(key: str) -> JobKey:
    """What a relative key of the job's prefix is; MalformedKeyError when it is none of them."""
    kind = _SINGLE.get(key)
    if kind is not None:
        return JobKey(kind)
    prefix, _, rest = key.partition("/")
    parts = rest.split("/") if rest else []
    if prefix + "/" == MEMBERS and len(parts) == 1 and _NODE_RE.match(parts[0]):
        return JobKey(KeyKind.MEMBER, node=parts[0])
    if prefix + "/" == DIRECTIVES and len(parts) == 1 and _NODE_RE.match(parts[0]):
        return JobKey(KeyKind.DIRECTIVE, node=parts[0])
    if prefix + "/" == PROCS and len(parts) == 1 and _SLOT_RE.match(parts[0]):
        return JobKey(KeyKind.PROC, node=split_slot(parts[0])[0], slot=parts[0])
    if (
        prefix + "/" == EXITS
        and len(parts) == 2
        and _SLOT_RE.match(parts[0])
        and _INCARNATION_RE.match(parts[1])
    ):
        node = split_slot(parts[0])[0]
        return JobKey(KeyKind.EXIT, node=node, slot=parts[0], incarnation=int(parts[1]))
    raise MalformedKeyError(key, _why(prefix + "/" if rest or key.endswith("/") else prefix))


def _why(prefix: str) -> str:
    shapes = {
        MEMBERS: f"{MEMBERS}<node-id>",
        DIRECTIVES: f"{DIRECTIVES}<node-id>",
        PROCS: f"{PROCS}<node-id>.<index>",
        EXITS: f"{EXITS}<node-id>.<index>/<incarnation>",
    }
    if prefix in shapes:
        return (
            f"expected {shapes[prefix]} (node ids: lowercase letters, digits and '-'; "
            "incarnations from 1)"
        )
    return "not a key of this job's layout (see docs/store.md)"
