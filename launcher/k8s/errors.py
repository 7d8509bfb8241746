"""The Kubernetes errors: one family inside the project's one exception tree.

Every class derives from :class:`KubernetesError` and from the project's class for its kind of
failure, so the command line's mapping (``ConfigError`` -> exit code 2, every other
``ElasticAllreduceError`` -> 3) holds without knowing about Kubernetes::

    ElasticAllreduceError
    ├── KubernetesError
    │   ├── KubernetesConfigError        (also ConfigError: no usable kubeconfig, bad template)
    │   └── KubernetesApiError           (also ProvisionerError: the API refused or failed)
    │       ├── KubernetesUnavailableError   (also UnavailableError: unreachable, TLS, timeout)
    │       ├── KubernetesForbiddenError     (401 / 403)
    │       ├── KubernetesNotFoundError      (404)
    │       └── KubernetesConflictError      (409)
    ├── ConfigError
    ├── UnavailableError
    └── ProvisionerError

Only :mod:`launcher.k8s.client` raises the API errors; callers add what the failure means to
them (``raise ... from exc``).
"""

from __future__ import annotations

from elastic_allreduce.errors import (
    ConfigError,
    ElasticAllreduceError,
    ProvisionerError,
    UnavailableError,
)


class KubernetesError(ElasticAllreduceError):
    """Base of every Kubernetes error of elastic-allreduce."""


class KubernetesConfigError(KubernetesError, ConfigError):
    """Bad input about the cluster: no usable kubeconfig or service account, a worker template
    the API rejects, a missing prerequisite the user must create (exit code 2)."""


class KubernetesApiError(KubernetesError, ProvisionerError):
    """The Kubernetes API refused or failed a request; the message names the verb, the
    resource, the namespace, the server's reason and what to change. ``status`` is the HTTP
    status when there was an answer (None when there was none)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubernetesUnavailableError(KubernetesApiError, UnavailableError):
    """The API server could not be reached: connection refused, DNS, TLS or a timeout."""


class KubernetesForbiddenError(KubernetesApiError):
    """Not authenticated (401) or not allowed by RBAC (403)."""


class KubernetesNotFoundError(KubernetesApiError):
    """The object, or its namespace, does not exist (404)."""


class KubernetesConflictError(KubernetesApiError):
    """The object exists already, or changed since it was read (409)."""
