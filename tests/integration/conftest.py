"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.harness import Job


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    """Jobs (and joiners) a test started; killed at its end if still running."""
    started: list[Job] = []
    yield started
    for job in started:
        job.stop()
