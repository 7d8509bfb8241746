"""Exit codes of every ``elastic-run`` command, in one place (documented in ``--help``)."""

from __future__ import annotations

from typing import Final

from elastic_allreduce.errors import ConfigError, ElasticAllreduceError

#: A job's own outcomes.
EXIT_SUCCEEDED: Final = 0
EXIT_JOB_FAILED: Final = 1
#: Bad input: a flag, a file, an unknown job, a certificate or credential etcd refuses -- the
#: message says what to change.
EXIT_BAD_INPUT: Final = 2
#: An operational error: etcd or the Kubernetes API unreachable or failing a request.
EXIT_OPERATIONAL: Final = 3
#: `join`: the node left a job that had no launcher for the leaderless grace.
EXIT_LEADERLESS: Final = 4
#: The job goes on under another launcher: SIGTERM to `run --kubernetes` (a drain, an
#: eviction) handed it over, or `run --standby` was stopped while it stood by.
EXIT_HANDED_OVER: Final = 5


def exit_code(error: ElasticAllreduceError) -> int:
    """2 for bad input (a ConfigError), 3 for every other failure."""
    return EXIT_BAD_INPUT if isinstance(error, ConfigError) else EXIT_OPERATIONAL
