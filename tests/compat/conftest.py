"""Fixtures of the compatibility suite: the integration tests' (jobs stopped at the end)."""

from tests.integration.conftest import jobs

__all__ = ["jobs"]
