"""The persistence channel between a training process and its agent (one owner: this module).

With a checkpoint folder (``--checkpoint-dir``), rank 0 of ``elastic_allreduce.State`` does
not write its checkpoints itself under ``elastic-run``: after the commit's snapshot is in the
slot's shared-memory folder (:mod:`elastic_allreduce.commits.shm`), it asks its agent to
persist it, and the agent copies the snapshot into the checkpoint folder
(:class:`launcher.node.persister.SnapshotPersister`). The disk write then costs the training
process nothing, and it completes even if the process dies meanwhile.

The channel is a ``SOCK_SEQPACKET`` socket pair the agent makes for each process it starts;
the process's end is inherited as the file descriptor in ``ELASTIC_ALLREDUCE_PERSIST_FD``. One
datagram per message, JSON objects, one request at a time:

* request ``{"persist": C}``: persist commit C (or a newer one, if the snapshot moved on);
* reply ``{"commit": C, "persisted": P, "path": "..."}``: the checkpoint folder holds commit
  P >= C (written now, or there already);
* reply ``{"commit": C, "skipped": "reason"}``: the write failed (a full disk): a skipped
  checkpoint, reported as such;
* reply ``{"commit": C, "declined": "reason"}``: the agent will not (it is stopping, or the
  snapshot is not there): the process writes the checkpoint itself.

Both sides parse what they receive into these records and refuse anything else: a malformed
message is a :class:`ProtocolError`, never acted upon.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from typing import Final

from elastic_allreduce import runtime
from elastic_allreduce.errors import ProtocolError

#: The largest message either side sends or accepts, in bytes.
MAX_MESSAGE: Final = 16 * 1024
#: Seconds a process waits for its agent's reply: a copy of a large state to a slow disk.
REPLY_TIMEOUT: Final = 300.0


@dataclass(frozen=True)
class PersistRequest:
    """Rank 0 to its agent: persist this commit's snapshot."""

    commit_id: int

    def to_bytes(self) -> bytes:
        return json.dumps({"persist": self.commit_id}).encode()

    @classmethod
    def parse(cls, data: bytes) -> PersistRequest:
        fields = _object(data, "request")
        commit = fields.get("persist")
        if set(fields) != {"persist"} or not _is_count(commit):
            raise ProtocolError(f"malformed persist request {data[:200]!r}")
        assert isinstance(commit, int)
        return cls(commit)


@dataclass(frozen=True)
class PersistReply:
    """The agent's answer to one request: exactly one of ``persisted`` (with ``path``),
    ``skipped`` and ``declined`` is set."""

    commit_id: int
    persisted: int | None = None
    path: str | None = None
    skipped: str | None = None
    declined: str | None = None

    def __post_init__(self) -> None:
        outcomes = [self.persisted is not None, self.skipped is not None, self.declined is not None]
        if outcomes.count(True) != 1 or (self.persisted is None) != (self.path is None):
            raise ProtocolError(f"a persist reply needs exactly one outcome: {self!r}")

    def to_bytes(self) -> bytes:
        fields: dict[str, object] = {"commit": self.commit_id}
        if self.persisted is not None:
            fields.update(persisted=self.persisted, path=self.path)
        elif self.skipped is not None:
            fields["skipped"] = self.skipped
        else:
            fields["declined"] = self.declined
        return json.dumps(fields).encode()

    @classmethod
    def parse(cls, data: bytes) -> PersistReply:
        fields = _object(data, "reply")
        commit = fields.get("commit")
        persisted = fields.get("persisted")
        texts = {name: fields.get(name) for name in ("path", "skipped", "declined")}
        if (
            not _is_count(commit)
            or not (persisted is None or _is_count(persisted))
            or not all(value is None or isinstance(value, str) for value in texts.values())
            or not set(fields) <= {"commit", "persisted", *texts}
        ):
            raise ProtocolError(f"malformed persist reply {data[:200]!r}")
        assert isinstance(commit, int)
        assert persisted is None or isinstance(persisted, int)
        path, skipped, declined = (texts[name] for name in ("path", "skipped", "declined"))
        assert path is None or isinstance(path, str)
        assert skipped is None or isinstance(skipped, str)
        assert declined is None or isinstance(declined, str)
        return cls(commit, persisted, path, skipped, declined)


class AgentLink:
    """A training process's end of the channel (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock

    @classmethod
    def from_env(cls) -> AgentLink | None:
        """The link the agent passed down (one per process, made at the first call), or None
        (outside elastic-run, no checkpoint folder, or an unusable descriptor)."""
        global _link_made, _link  # noqa: PLW0603 - one inherited descriptor per process
        with _link_lock:
            if not _link_made:
                _link_made = True
                _link = cls._inherited(runtime.contract().persist_fd)
            return _link

    @classmethod
    def _inherited(cls, fd: int | None) -> AgentLink | None:
        if fd is None:
            return None
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.detach()
            return None
        return cls(sock)

    def persist(self, commit_id: int, timeout: float = REPLY_TIMEOUT) -> PersistReply | None:
        """Ask the agent to persist ``commit_id``; its reply, or None when no agent answers
        (it is gone, or took longer than ``timeout``: the link is then closed, so a late
        reply is never taken for the next request's). Raises ProtocolError for a reply that
        is malformed or about another commit."""
        sock = self._sock
        if sock is None:
            return None
        try:
            sock.settimeout(timeout)
            sock.send(PersistRequest(commit_id).to_bytes())
            data = sock.recv(MAX_MESSAGE)
        except OSError:
            self.close()
            return None
        if not data:
            self.close()
            return None
        reply = PersistReply.parse(data)
        if reply.commit_id != commit_id:
            raise ProtocolError(f"a persist reply for commit {reply.commit_id}, not {commit_id}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


_link_lock = threading.Lock()
_link_made = False
_link: AgentLink | None = None


def _object(data: bytes, what: str) -> dict[str, object]:
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a persist {what} of {len(data)} bytes (at most {MAX_MESSAGE})")
    try:
        fields = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"a persist {what} that is not JSON: {data[:200]!r}") from exc
    if not isinstance(fields, dict):
        raise ProtocolError(f"a persist {what} that is not an object: {data[:200]!r}")
    return fields


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
