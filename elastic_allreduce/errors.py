"""The one exception tree of elastic-allreduce.

Every error the project raises on purpose derives from :class:`ElasticAllreduceError`, so a
caller (or the CLI) can catch one type and print one clear message. Messages say what
happened, with the values involved, and what to change.
"""

from __future__ import annotations


class ElasticAllreduceError(Exception):
    """Base of every error raised by elastic-allreduce on purpose."""


class ConfigError(ElasticAllreduceError):
    """A setting, flag or argument is invalid; the message names it and the valid values.

    The command line exits with code 2 (bad input) for these and only these."""


class UnavailableError(ElasticAllreduceError):
    """A service the caller needs (etcd, the Kubernetes API) did not answer: an operational
    problem, not bad input (the command line exits with code 3 for every error but ConfigError).
    """


class StoreError(ElasticAllreduceError):
    """The membership store failed an operation."""


class StoreUnavailableError(StoreError, UnavailableError):
    """No etcd endpoint answered (connection refused, timed out, or the server is not ready)."""


class StoreAuthError(StoreError, ConfigError):
    """etcd and this client do not accept each other: etcd's certificate fails verification
    against the CA given, etcd refuses the client certificate (or its absence), the user name or
    password is wrong, or the user has no permission on a key. The message says which, with the
    file, user or key involved, and what to change. A ConfigError as well: the command line
    exits with 2, since the fix is a different flag, file or grant, not a retry."""


class MalformedValueError(StoreError):
    """A stored value is not JSON in the envelope this version of elastic-allreduce reads."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"value of key {key!r} is malformed: {reason}")
        self.key = key
        self.reason = reason


class MalformedKeyError(StoreError):
    """A key under a job's prefix fits none of the job's key shapes (see records.keys)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"key {key!r} is not one of the job's keys: {reason}")
        self.key = key
        self.reason = reason


class LeaseLostError(StoreError):
    """The server no longer knows a lease: its keys are gone and keep-alive cannot revive it."""


class WatchClosedError(StoreError):
    """A watch was read after :meth:`Watch.close`."""


class EtcdServerError(StoreError):
    """A private etcd server could not be found, started or stopped."""


class ProtocolError(ElasticAllreduceError):
    """A peer's message (a rendezvous reply, an output line) does not follow the protocol."""


class ProvisionerError(ElasticAllreduceError):
    """A provisioner could not start, stop or watch worker nodes."""


class CheckpointError(ElasticAllreduceError):
    """A checkpoint cannot be loaded: unreadable, truncated, another job's or another state's.
    The loader skips it with a warning and tries the previous one
    (elastic_allreduce.commits.checkpoint).
    """


class StateMismatchError(ElasticAllreduceError):
    """The ranks of a ring epoch hold training states of different shapes (other variables,
    shapes, dtypes or extra attributes), so the state cannot be synced: raised on every rank at
    once, instead of the silent deadlock a mismatched broadcast would be."""


class StateValueError(StateMismatchError, ConfigError):
    """A training state's extra attribute is not plain data (JSON: None, bool, int, float, str,
    lists and str-keyed dicts of these), so the ranks could not exchange it without pickling.
    Raised when the State is made and, on every rank at once, at a commit or sync; a
    StateMismatchError too, so the job fails at once instead of restarting into it again."""
