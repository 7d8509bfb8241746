"""The agent's side of the persistence channel: slots' snapshots copied into the checkpoint
folder, off the training processes' critical path (:mod:`elastic_allreduce.commits.persistence`).

For each process it starts, the agent asks :meth:`SnapshotPersister.link` for a socket pair:
the process gets one end, a reader thread of the agent waits on the other. Requests go, in
arrival order, to one copier thread, which copies the newest snapshot of the slot's folder
into ``<checkpoint-dir>/<job-id>/`` (:meth:`CheckpointFolder.copy_in`: durable, the last K
kept) and replies. :meth:`close` lets the copy under way finish and declines the rest: the
agent calls it before it sends SIGTERM to its processes, so rank 0's own last-commit write on
SIGTERM never races with a copy of the agent. Stdlib only: the agent imports no NumPy.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from elastic_allreduce.commits.folder import Checkpoint, CheckpointFolder, Skipped
from elastic_allreduce.commits.persistence import MAX_MESSAGE, PersistReply, PersistRequest
from elastic_allreduce.errors import ProtocolError

log = logging.getLogger(__name__)

#: Why a request is declined once the agent stops.
STOPPING: Final = "the node's agent is stopping"


@dataclass(frozen=True)
class _Job:
    slot: str
    snapshots: Path
    request: PersistRequest
    sock: socket.socket


class SnapshotPersister:
    """Persists the snapshots of one agent's slots into the job's checkpoint folder."""

    def __init__(self, root: str, job_id: str, keep: int) -> None:
        self.checkpoints = CheckpointFolder(root, job_id, keep)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._copier = threading.Thread(target=self._copy_loop, name="persister", daemon=True)
        self._copier.start()

    def link(self, slot: str, snapshots: Path) -> socket.socket:
        """A new channel for the process of ``slot``, whose snapshots are in ``snapshots``:
        returns the process's end (inheritable; the caller closes it once the process has
        it). The agent's end is served by a thread of its own until the process closes it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        threading.Thread(
            target=self._serve, args=(slot, snapshots, ours), name=f"persist-{slot}", daemon=True
        ).start()
        return theirs

    def close(self, timeout: float) -> bool:
        """Decline every request from now on and wait up to ``timeout`` seconds for the copy
        under way; whether it ended."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        self._copier.join(timeout)
        return not self._copier.is_alive()

    # -- threads -----------------------------------------------------------------------------

    def _serve(self, slot: str, snapshots: Path, sock: socket.socket) -> None:
        """One slot's channel: parse each request and queue it, until the process is gone."""
        with sock:
            while True:
                try:
                    data = sock.recv(MAX_MESSAGE)
                except OSError:
                    return
                if not data:
                    return
                try:
                    request = PersistRequest.parse(data)
                except ProtocolError as exc:
                    log.warning("slot %s: ignoring a malformed persist request: %s", slot, exc)
                    continue
                with self._lock:
                    if not self._closed:
                        self._jobs.put(_Job(slot, snapshots, request, sock))
                        continue
                _reply(sock, PersistReply(request.commit_id, declined=STOPPING))

    def _copy_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            _reply(job.sock, self._persist(job))
        # Requests queued before close: declined, so their processes write themselves.
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _reply(job.sock, PersistReply(job.request.commit_id, declined=STOPPING))

    def _persist(self, job: _Job) -> PersistReply:
        commit = job.request.commit_id
        source = CheckpointFolder.at(
            job.snapshots, self.checkpoints.job_id, 1, kind="snapshot", full_hint=""
        )
        newest = source.checkpoints()
        if not newest or newest[0].commit_id < commit:
            have = newest[0].commit_id if newest else None
            return PersistReply(commit, declined=f"the slot's newest snapshot is commit {have}")
        started = time.monotonic()
        written = self.checkpoints.copy_in(source)
        if isinstance(written, Skipped):
            if written.attempted:
                return PersistReply(commit, skipped=written.reason)
            return PersistReply(commit, declined=written.reason)
        _log_written(job.slot, written, time.monotonic() - started)
        return PersistReply(commit, persisted=written.commit_id, path=str(written.path))


def _log_written(slot: str, written: Checkpoint, seconds: float) -> None:
    size = sum(f.stat().st_size for f in written.path.iterdir() if f.is_file())
    log.info(
        "persisted slot %s's snapshot of commit %d to %s (%.1f MiB in %.2f s)",
        slot,
        written.commit_id,
        written.path,
        size / 2**20,
        seconds,
    )


def _reply(sock: socket.socket, reply: PersistReply) -> None:
    with contextlib.suppress(OSError):  # the process is gone: nothing waits for the answer
        sock.send(reply.to_bytes())
