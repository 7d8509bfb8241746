"""The one exception tree of elastic-allreduce.

Every error the project raises on purpose derives from :class:`ElasticAllreduceError`, so a
caller (or the CLI) can catch one type and print one clear message. Messages say what
happened, with the values involved, and what to change.
"""

from __future__ import annotations


class ElasticAllreduceError(Exception):
    """Base of every error raised by elastic-allreduce on purpose."""


class ConfigError(ElasticAllreduceError):
    """A setting, flag or argument is invalid; the message names it and the valid values."""


class StoreError(ElasticAllreduceError):
    """The membership store failed an operation."""


class StoreUnavailableError(StoreError):
    """No etcd endpoint answered (connection refused, timed out, or the server is not ready)."""


class MalformedValueError(StoreError):
    """A stored value is not JSON in the envelope this version of elastic-allreduce reads."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"value of key {key!r} is malformed: {reason}")
        self.key = key
        self.reason = reason


class LeaseLostError(StoreError):
    """The server no longer knows a lease: its keys are gone and keep-alive cannot revive it."""


class WatchClosedError(StoreError):
    """A watch was read after :meth:`Watch.close`."""


class EtcdServerError(StoreError):
    """A private etcd server could not be found, started or stopped."""


class ProvisionerError(ElasticAllreduceError):
    """A provisioner could not start, stop or watch worker nodes."""


class KubernetesApiError(ProvisionerError):
    """The Kubernetes API refused or failed a request (the message names verb, resource, why)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
