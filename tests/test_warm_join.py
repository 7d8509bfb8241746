"""Warm joiners (issue #15, item 1), in-process: the job option, the launcher's barrier for a
warm joiner (its ``hvd.init()`` in the ring asks ``rank_and_size`` once more, which must not
count as a reset), the barrier's one open request per slot, and ``warm_up`` outside a warm
joiner. End to end: tests/integration/test_warm_join.py."""

from __future__ import annotations

import argparse
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from elastic_allreduce.records.values import JobSettings
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.rendezvous.model import REMOVED, SlotAssignment
from elastic_allreduce.rendezvous.protocol import Admission, WaitKind
from elastic_allreduce.training import warm
from launcher import job_options
from launcher.leader.rendezvous import ReadinessBoard, RendezvousService

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0ken"  # noqa: S105 - a test token


def test_warm_join_is_the_default_job_option_and_can_be_turned_off() -> None:
    """Issue #39, item 4: a newcomer's code before its elastic run never meets the survivors'
    sync by default; --no-warm-join admits it before its script starts, as before."""
    parser = argparse.ArgumentParser()
    job_options.add_job_flags(parser)
    job_options.add_command(parser)
    default = job_options.job_options(["t.py"])
    assert job_options.job_settings(default).warm_join
    assert job_options.from_args(parser.parse_args(["--", "t.py"])).warm_join
    assert "--warm-join" not in job_options.to_args(default)
    assert job_options.from_args(parser.parse_args(["--warm-join", "--", "t.py"])).warm_join
    parsed = job_options.from_args(parser.parse_args(["--no-warm-join", "--", "t.py"]))
    settings = job_options.job_settings(parsed)
    assert not settings.warm_join
    assert JobSettings.from_json("config/job", settings.to_json()) == settings
    assert "--no-warm-join" in job_options.to_args(parsed)
    assert job_options.from_args(parser.parse_args(job_options.to_args(parsed))) == parsed
    # A record written before the field has the default.
    older = {k: v for k, v in settings.to_json().items() if k != "warm_join"}
    assert JobSettings.from_json("config/job", older).warm_join


class Waiter:
    """``board.wait`` on a thread of its own; ``answer`` once it returned."""

    def __init__(self, board: ReadinessBoard, slot: str, kind: WaitKind, *, warm: bool) -> None:
        self.answer: Admission | None = None
        self._thread = threading.Thread(
            target=lambda: setattr(self, "answer", board.wait(slot, kind, 30, warm=warm))
        )
        self._thread.start()

    def join(self) -> Admission | None:
        self._thread.join(10)
        assert not self._thread.is_alive()
        return self.answer


def wait_until_waiting(board: ReadinessBoard, slot: str) -> None:
    changed = threading.Event()
    for _ in range(200):
        if slot in board.waiting():
            return
        changed.wait(0.01)
    raise AssertionError(f"{slot} never came to wait")


def admission(epoch: int, rank: int, size: int) -> Admission:
    return Admission(epoch, SlotAssignment(rank, size, cross_rank=rank, cross_size=size))


def admit(
    board: ReadinessBoard,
    slot: str,
    answer: Admission,
    *,
    kind: WaitKind = WaitKind.FRESH,
    warm: bool = False,
) -> Admission:
    """``slot`` waits at the board and is answered ``answer`` (the launcher formed its epoch)."""
    waiter = Waiter(board, slot, kind, warm=warm)
    wait_until_waiting(board, slot)
    if warm:
        assert board.warm_init(slot) is None  # not admitted yet
    board.answer({slot: answer})
    assert waiter.join() == answer
    return answer


def test_a_warm_joiner_s_first_init_in_its_epoch_is_answered_at_once_and_only_once() -> None:
    board = ReadinessBoard(lambda: None)
    admitted = admit(board, "j.0", admission(2, 2, 3), warm=True)
    # Its hvd.init() in the ring: the same ranks, without waiting and without a reset.
    assert board.warm_init("j.0") == admitted
    assert board.waiting() == {}
    # A later request of the slot is a reset like any other member's.
    assert board.warm_init("j.0") is None


def test_a_warm_joiner_s_init_after_a_newer_epoch_waits_as_a_reset() -> None:
    board = ReadinessBoard(lambda: None)
    admit(board, "j.0", admission(2, 2, 3), warm=True)
    # A peer failed before the joiner initialised: epoch 3 re-formed with the others.
    admit(board, "n0.0", admission(3, 0, 3), kind=WaitKind.RESET)
    assert board.warm_init("j.0") is None


def test_a_newer_request_of_a_slot_supersedes_an_open_one_and_gets_the_answer() -> None:
    """A SIGKILLed process leaves its barrier request open at the launcher; its restarted
    process asks again. The old request is answered REMOVED at once (it goes to a dead socket)
    and the admission reaches the new one (both used to wait, and either took the answer)."""
    board = ReadinessBoard(lambda: None)
    dead = Waiter(board, "n0.0", WaitKind.RESET, warm=False)
    wait_until_waiting(board, "n0.0")
    live = Waiter(board, "n0.0", WaitKind.FRESH, warm=False)
    assert dead.join() == Admission(-1, REMOVED)
    assert board.waiting() == {"n0.0": WaitKind.FRESH}
    answer = admission(4, 0, 1)
    board.answer({"n0.0": answer})
    assert live.join() == answer
    assert board.waiting() == {}


def test_a_process_that_is_not_warm_gets_no_early_answer() -> None:
    board = ReadinessBoard(lambda: None)
    admit(board, "n1.0", admission(1, 1, 2))
    assert board.warm_init("n1.0") is None


@pytest.fixture
def service() -> Iterator[tuple[ReadinessBoard, str]]:
    board = ReadinessBoard(lambda: None)
    rendezvous = RendezvousService(board, wait_timeout=30.0)
    port = rendezvous.start("127.0.0.1", TOKEN)
    try:
        yield board, f"127.0.0.1:{port}"
    finally:
        rendezvous.stop()


def get(url: str) -> bytes:
    request = urllib.request.Request(url, headers={protocol.TOKEN_HEADER: TOKEN})  # noqa: S310
    with urllib.request.urlopen(request, timeout=20) as reply:  # noqa: S310 - http://
        body: bytes = reply.read()
        return body


def test_the_rendezvous_serves_the_warm_barrier_and_then_the_same_ranks(
    service: tuple[ReadinessBoard, str],
) -> None:
    board, address = service
    answers: list[bytes] = []
    thread = threading.Thread(
        target=lambda: answers.append(get(protocol.ready_url(address, "j.0", warm=True)))
    )
    thread.start()
    wait_until_waiting(board, "j.0")
    assert board.waiting() == {"j.0": WaitKind.FRESH}
    board.answer({"j.0": admission(4, 1, 2)})
    thread.join(10)
    assert protocol.decode_admission(answers[0]) == admission(4, 1, 2)
    ranks = get(protocol.rank_and_size_url(address, "j.0"))
    assert ranks == protocol.encode_assignment(admission(4, 1, 2).assignment)


def test_warm_up_does_nothing_outside_a_warm_joiner() -> None:
    calls: list[int] = []
    assert not warm.provisional()
    assert warm.warm_up(lambda: calls.append(1)) is False
    assert calls == []
