"""Fixtures of the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tests.helpers import testhosts
from tests.helpers.testhosts import TestHosts
from tests.integration.harness import Job


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    """Jobs (and joiners) a test started; killed at its end if still running."""
    started: list[Job] = []
    yield started
    for job in started:
        job.stop()


#: ``make(count)`` returns a started group of ``count`` test hosts (see tests/helpers/testhosts.py).
MakeTestHosts = Callable[[int], TestHosts]


@pytest.fixture
def netns_available() -> None:
    """Skip (with the reason, shown by ``-ra``) where network namespaces cannot be made."""
    reason = testhosts.available()
    if reason is not None:
        pytest.skip(f"test hosts unavailable: {reason}")


@pytest.fixture
def test_hosts(netns_available: None) -> Iterator[MakeTestHosts]:
    """Makes groups of test hosts (network namespaces on one bridge); every group is killed
    and deleted at the end of the test, and the test fails if that cleanup fails."""
    made: list[TestHosts] = []

    def make(count: int) -> TestHosts:
        hosts = TestHosts(count)
        made.append(hosts)
        return hosts.start()

    yield make
    problems: list[str] = []
    for hosts in reversed(made):
        inside = [pid for pids in hosts.processes().values() for pid in pids]
        try:
            hosts.close()
        except testhosts.TestHostsError as exc:
            problems.append(str(exc))
        else:
            problems.extend(_still_running(inside, timeout=5.0))
    assert not problems, "test hosts were not cleaned up: " + "; ".join(problems)


def _still_running(pids: list[int], timeout: float) -> list[str]:
    """``pids`` that still run (zombies count as gone) once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        running = [pid for pid in pids if testhosts.process_running(pid)]
        if not running or time.monotonic() >= deadline:
            return [f"process {pid} still runs" for pid in running]
        time.sleep(0.02)


def assert_no_processes_left(hosts: TestHosts, pids: list[int] | None = None) -> None:
    """Fail if any process still runs in any namespace of ``hosts``, or (when given) any of
    ``pids`` still runs at all (a namespace that is gone hides its processes from ``ip``)."""
    left = hosts.processes()
    assert not left, f"processes left in the test hosts' namespaces: {left}"
    running = _still_running(pids or [], timeout=5.0)
    assert not running, f"processes of the test hosts still run: {running}"
