"""The persistence channel (issue #17, item 2: the agent persists the newest snapshot to the
checkpoint folder in the background): its records, the agent's persister over a real socket
pair, and rank 0's persister that falls back to writing itself.

Real files, real sockets and threads; the training process's side is driven directly (no
TensorFlow): :class:`CheckpointPersister` gets the commit's arrays as the snapshot writer would
hand them over.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from elastic_allreduce import progress
from elastic_allreduce.commits import folder as checkpoint_files
from elastic_allreduce.commits.checkpoint import CheckpointDir
from elastic_allreduce.commits.persistence import AgentLink, PersistReply, PersistRequest
from elastic_allreduce.commits.snapshots import CheckpointPersister
from elastic_allreduce.errors import ProtocolError
from launcher.node.persister import STOPPING, SnapshotPersister

JOB = "job-a"
FINGERPRINT = "f" * 16


def arrays(commit: int) -> list[npt.NDArray[Any]]:
    return [np.full(1000, commit, np.float32), np.arange(5, dtype=np.int64) + commit]


@pytest.fixture
def slot_folder(tmp_path: Path) -> CheckpointDir:
    """A slot's snapshot folder as the agent makes it, written as a State writes it."""
    folder = tmp_path / "shm" / JOB / "n0.0"
    folder.mkdir(parents=True)
    return CheckpointDir.at(folder, JOB, 1, kind="snapshot", full_hint="raise it")


def snapshot(folder: CheckpointDir, commit: int) -> None:
    assert folder.write(commit, arrays(commit), {"commit_id": commit}, FINGERPRINT) is not None


def fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file the checkpoint folder writes from now on meets a full disk."""

    def full(path: Path, write: object, *, exclusive: bool = True) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_files, "_write_file", full)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[SnapshotPersister]:
    persister = SnapshotPersister(str(tmp_path / "ckpt"), JOB, keep=2)
    yield persister
    persister.close(10)


def link_to(agent: SnapshotPersister, folder: CheckpointDir) -> AgentLink:
    return AgentLink(agent.link("n0.0", folder.path))


def job_folder(tmp_path: Path) -> CheckpointDir:
    return CheckpointDir(tmp_path / "ckpt", JOB, keep=2)


# -- records -----------------------------------------------------------------------------------


def test_records_round_trip() -> None:
    assert PersistRequest.parse(PersistRequest(7).to_bytes()) == PersistRequest(7)
    for reply in (
        PersistReply(7, persisted=9, path="/c/ckpt-1"),
        PersistReply(7, skipped="no space"),
        PersistReply(7, declined=STOPPING),
    ):
        assert PersistReply.parse(reply.to_bytes()) == reply


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[1]",
        b'{"persist": -1}',
        b'{"persist": true}',
        b'{"persist": "7"}',
        b'{"persist": 7, "rm": "-rf"}',
        b'{"persist": 7}' + b" " * 20000,
    ],
)
def test_a_malformed_request_is_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        PersistRequest.parse(data)


@pytest.mark.parametrize(
    "data",
    [
        b'{"commit": 7}',
        b'{"commit": 7, "persisted": 8}',
        b'{"commit": 7, "skipped": "x", "declined": "y"}',
        b'{"commit": 7, "skipped": 3}',
        b'{"commit": "7", "declined": "y"}',
        b'{"commit": 7, "declined": "y", "extra": 1}',
    ],
)
def test_a_malformed_reply_is_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        PersistReply.parse(data)


# -- the agent's persister -----------------------------------------------------------------------


def test_the_agent_copies_the_slots_newest_snapshot_durably_and_keeps_k(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    link = link_to(agent, slot_folder)
    paths = []
    for commit in (10, 20, 30):
        snapshot(slot_folder, commit)
        reply = link.persist(commit, timeout=30)
        assert reply is not None and reply.persisted == commit, reply
        paths.append(reply.path)
    folder = job_folder(tmp_path)
    assert [c.commit_id for c in folder.checkpoints()] == [30, 20]  # keep 2
    newest = folder.checkpoints()[0]
    assert paths[-1] == str(newest.path)
    source = slot_folder.checkpoints()[0].path
    for name in (checkpoint_files.ARRAYS, checkpoint_files.META):
        assert (newest.path / name).read_bytes() == (source / name).read_bytes()
    assert (folder.path / checkpoint_files.LATEST).read_text().strip() == newest.path.name
    loaded = folder.load(FINGERPRINT)
    assert loaded is not None and loaded.attributes == {"commit_id": 30}
    np.testing.assert_array_equal(loaded.arrays[0], arrays(30)[0])
    assert not [p for p in folder.path.iterdir() if p.name.startswith(".staging-")]


def test_a_newer_snapshot_than_asked_for_is_the_one_persisted(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    snapshot(slot_folder, 12)
    reply = link_to(agent, slot_folder).persist(10, timeout=30)
    assert reply is not None and reply.persisted == 12, reply


def test_an_older_snapshot_than_asked_for_is_declined(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    snapshot(slot_folder, 8)
    reply = link_to(agent, slot_folder).persist(10, timeout=30)
    assert reply is not None and reply.declined is not None and "commit 8" in reply.declined
    assert job_folder(tmp_path).checkpoints() == []


def test_a_snapshot_of_another_job_is_not_persisted(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    snapshot(slot_folder, 10)
    meta = slot_folder.checkpoints()[0].path / checkpoint_files.META
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "job_id": "job-b"}))
    reply = link_to(agent, slot_folder).persist(10, timeout=30)
    assert reply is not None and reply.declined is not None and "job-b" in reply.declined
    assert job_folder(tmp_path).checkpoints() == []


def test_a_full_disk_is_a_skipped_checkpoint_and_leaves_nothing(
    tmp_path: Path,
    slot_folder: CheckpointDir,
    agent: SnapshotPersister,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    snapshot(slot_folder, 10)

    fill_the_disk(monkeypatch)
    with caplog.at_level(logging.WARNING):
        reply = link_to(agent, slot_folder).persist(10, timeout=30)
    assert reply is not None and reply.skipped is not None, reply
    assert "no space left on the device" in reply.skipped
    assert "skipped the checkpoint of commit 10" in caplog.text
    folder = job_folder(tmp_path)
    assert folder.checkpoints() == [] and list(folder.path.iterdir()) == []


def test_a_closed_persister_declines_and_a_copy_under_way_finishes_first(
    tmp_path: Path,
    slot_folder: CheckpointDir,
    agent: SnapshotPersister,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot(slot_folder, 10)
    copying, release = threading.Event(), threading.Event()
    real_copy = checkpoint_files._copy_bytes

    def slow_copy(source: object, target: object) -> None:
        copying.set()
        assert release.wait(30)
        real_copy(source, target)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_files, "_copy_bytes", slow_copy)
    link = link_to(agent, slot_folder)
    replies: list[PersistReply | None] = []
    asking = threading.Thread(target=lambda: replies.append(link.persist(10, timeout=30)))
    asking.start()
    assert copying.wait(30)
    closed: list[bool] = []
    closing = threading.Thread(target=lambda: closed.append(agent.close(30)))
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()  # waits for the copy under way
    release.set()
    closing.join(30)
    asking.join(30)
    assert closed == [True]
    assert replies[0] is not None and replies[0].persisted == 10
    reply = link.persist(10, timeout=30)
    assert reply == PersistReply(10, declined=STOPPING)


def test_a_malformed_request_gets_no_answer_and_the_next_one_is_served(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    snapshot(slot_folder, 10)
    sock = agent.link("n0.0", slot_folder.path)
    sock.settimeout(30)
    sock.send(b'{"persist": "__import__(\'os\')"}')
    sock.send(PersistRequest(10).to_bytes())
    assert PersistReply.parse(sock.recv(4096)).persisted == 10
    sock.close()


def test_a_snapshot_replaced_during_the_copy_is_retried_with_the_new_one(
    tmp_path: Path,
    slot_folder: CheckpointDir,
    agent: SnapshotPersister,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot(slot_folder, 10)
    real_checkpoints = checkpoint_files.CheckpointFolder.checkpoints
    calls: list[checkpoint_files.Checkpoint] = []

    def replaced_after_listing(
        self: checkpoint_files.CheckpointFolder,
    ) -> list[checkpoint_files.Checkpoint]:
        found = real_checkpoints(self)
        if self.kind == "snapshot" and found:
            calls.append(found[0])
            if len(calls) == 2:  # the copy's own listing: the writer replaces it right after
                snapshot(slot_folder, 11)  # keeps one: commit 10's folder is gone now
        return found

    monkeypatch.setattr(checkpoint_files.CheckpointFolder, "checkpoints", replaced_after_listing)
    reply = link_to(agent, slot_folder).persist(10, timeout=30)
    # The copy listed commit 10, whose folder went before it was opened: it took 11 instead.
    assert calls[1].commit_id == 10 and not calls[1].path.exists(), calls
    assert reply is not None and reply.persisted == 11, reply


# -- rank 0's persister ----------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.persisted: list[int] = []

    def __call__(self, commit_id: int) -> None:
        self.persisted.append(commit_id)


def commit(number: int) -> tuple[int, list[npt.NDArray[Any]], dict[str, Any]]:
    return number, arrays(number), {"commit_id": number}


def test_without_an_agent_rank_0_writes_the_checkpoint_on_its_thread(tmp_path: Path) -> None:
    folder = job_folder(tmp_path)
    recorder = Recorder()
    persister = CheckpointPersister(folder, None, FINGERPRINT, threading.RLock(), recorder)
    persister.submit(commit(10), from_snapshot=True)
    assert persister.flush(30)
    assert recorder.persisted == [10]
    assert [c.commit_id for c in folder.checkpoints()] == [10]


def test_with_an_agent_the_agent_writes_it(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    snapshot(slot_folder, 10)
    recorder = Recorder()
    persister = CheckpointPersister(
        job_folder(tmp_path),
        link_to(agent, slot_folder),
        "another fingerprint: a write here would record it",
        threading.RLock(),
        recorder,
    )
    persister.submit(commit(10), from_snapshot=True)
    assert persister.flush(30)
    assert recorder.persisted == [10]
    meta = json.loads((job_folder(tmp_path).checkpoints()[0].path / "meta.json").read_text())
    assert meta["fingerprint"] == FINGERPRINT  # the snapshot's bytes, not a write of its own


def test_a_skipped_snapshot_is_written_here_not_asked_of_the_agent(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    recorder = Recorder()
    persister = CheckpointPersister(
        job_folder(tmp_path), link_to(agent, slot_folder), FINGERPRINT, threading.RLock(), recorder
    )
    persister.submit(commit(10), from_snapshot=False)
    assert persister.flush(30)
    assert recorder.persisted == [10]


def test_a_declined_request_or_a_gone_agent_is_written_here(
    tmp_path: Path, slot_folder: CheckpointDir, agent: SnapshotPersister
) -> None:
    recorder = Recorder()
    link = link_to(agent, slot_folder)
    persister = CheckpointPersister(
        job_folder(tmp_path), link, FINGERPRINT, threading.RLock(), recorder
    )
    persister.submit(commit(10), from_snapshot=True)  # no snapshot 10: declined
    assert persister.flush(30)
    agent.close(10)
    persister.submit(commit(20), from_snapshot=True)  # declined: stopping
    assert persister.flush(30)
    assert recorder.persisted == [10, 20]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()  # the agent is gone
    persister = CheckpointPersister(
        job_folder(tmp_path), AgentLink(ours), FINGERPRINT, threading.RLock(), recorder
    )
    persister.submit(commit(30), from_snapshot=True)
    assert persister.flush(30)
    assert recorder.persisted == [10, 20, 30]
    assert [c.commit_id for c in job_folder(tmp_path).checkpoints()] == [30, 20]


def test_the_agents_skip_is_counted_as_a_skipped_checkpoint(
    tmp_path: Path,
    slot_folder: CheckpointDir,
    agent: SnapshotPersister,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot(slot_folder, 10)

    fill_the_disk(monkeypatch)
    before = progress._counts.checkpoints_skipped
    recorder = Recorder()
    persister = CheckpointPersister(
        job_folder(tmp_path), link_to(agent, slot_folder), FINGERPRINT, threading.RLock(), recorder
    )
    persister.submit(commit(10), from_snapshot=True)
    assert persister.flush(30)
    assert recorder.persisted == []
    assert progress._counts.checkpoints_skipped == before + 1
    assert "no space left" in (progress._counts.checkpoint_skip or "")
    assert "agent" in (progress._counts.checkpoint_skip or "")
