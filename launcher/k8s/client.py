"""The few Kubernetes API calls ``elastic-run k8s`` makes, with errors that say what to do.

:func:`connect` loads a kubeconfig (``--kubeconfig``, ``$KUBECONFIG`` or ``~/.kube/config``)
or, inside a pod without one, the in-cluster service account. :class:`Kube` sends plain REST
calls through the official client's ``ApiClient`` for the kinds that ``render`` produces (no
discovery round trips), and turns every failure into a :class:`KubeError`:

- no usable configuration → :class:`KubeConfigError`;
- connection refused, DNS, TLS or timeout → :class:`KubeUnavailableError`;
- 401 / 403 → :class:`KubeForbiddenError` (names the verb, resource and namespace);
- 404 → :class:`KubeNotFoundError`; 409 → :class:`KubeConflictError`; anything else
  → :class:`KubeError` with the server's message.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import kubernetes
import urllib3

from elastic_allreduce.errors import ConfigError, ElasticAllreduceError

Manifest = dict[str, Any]

# The client library's functions are untyped: reach them through Any, not ignore comments.
k8s_client: Any = kubernetes.client
k8s_config: Any = kubernetes.config

#: Seconds one API request may take (connect + read).
REQUEST_TIMEOUT: Final = 30.0


class KubeError(ElasticAllreduceError):
    """A Kubernetes API request failed; ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeConfigError(KubeError, ConfigError):
    """No cluster is configured, or the kubeconfig cannot be used."""


class KubeUnavailableError(KubeError):
    """The API server could not be reached (refused, DNS, TLS, timeout)."""


class KubeForbiddenError(KubeError):
    """The API server refused the request: not authenticated (401) or not allowed (403)."""


class KubeNotFoundError(KubeError):
    """The object (or its namespace) does not exist (404)."""


class KubeConflictError(KubeError):
    """The object already exists, or changed since it was read (409)."""


@dataclass(frozen=True)
class Kind:
    """Where the API serves one kind of object."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced:
            if not namespace:
                raise ConfigError(f"{self.kind} is namespaced: a namespace is needed")
            root += f"/namespaces/{namespace}"
        root += f"/{self.plural}"
        return root if name is None else f"{root}/{name}"


KINDS: Final = {
    kind.kind: kind
    for kind in (
        Kind("v1", "Namespace", "namespaces", namespaced=False),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("batch/v1", "Job", "jobs"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("scheduling.k8s.io/v1", "PriorityClass", "priorityclasses", namespaced=False),
    )
}


def kind_of(manifest: Manifest) -> Kind:
    """The :class:`Kind` of a manifest; ConfigError for a kind this module does not handle."""
    kind = KINDS.get(str(manifest.get("kind")))
    if kind is None or kind.api_version != manifest.get("apiVersion"):
        raise ConfigError(
            f"cannot apply {manifest.get('apiVersion')}/{manifest.get('kind')}: elastic-run k8s "
            f"handles {', '.join(sorted(KINDS))}"
        )
    return kind


def connect(
    kubeconfig: str | None = None, context: str | None = None
) -> kubernetes.client.ApiClient:
    """An API client from a kubeconfig, or the in-cluster service account inside a pod."""
    default = Path(os.path.expanduser(k8s_config.KUBE_CONFIG_DEFAULT_LOCATION))
    in_pod = "KUBERNETES_SERVICE_HOST" in os.environ and "KUBECONFIG" not in os.environ
    if kubeconfig is None and context is None and in_pod and not default.exists():
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException as exc:
            raise KubeConfigError(
                f"inside a pod, but its service account cannot be used: {exc}; mount a "
                "service account token or pass --kubeconfig"
            ) from exc
        in_cluster: kubernetes.client.ApiClient = k8s_client.ApiClient(configuration)
        return in_cluster
    source = kubeconfig or os.environ.get("KUBECONFIG") or str(default)
    try:
        client: kubernetes.client.ApiClient = k8s_config.new_client_from_config(
            config_file=kubeconfig, context=context, persist_config=False
        )
    except (k8s_config.ConfigException, OSError, ValueError, TypeError) as exc:
        raise KubeConfigError(
            f"no usable Kubernetes cluster configuration in {source}"
            + (f" (context {context!r})" if context else "")
            + f": {str(exc).rstrip('.')}. Point --kubeconfig or KUBECONFIG at a kubeconfig "
            "file (`kubectl config view` shows yours), or run inside a pod with a service account"
        ) from exc
    return client


def _server_message(body: bytes | str | None) -> str:
    if not body:
        return ""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        status = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300]
    message = status.get("message") if isinstance(status, dict) else None
    if isinstance(message, str):
        return message
    return text.strip()[:300]


_VERBS: Final = {"POST": "create", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}


class Kube:
    """Create, read, replace, list and delete objects of the kinds in :data:`KINDS`."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        # Typed Any: the client's methods are untyped.
        self.api: Any = api

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> Kube:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        kind: Kind,
        namespace: str | None,
        name: str | None = None,
        *,
        body: Manifest | None = None,
        query: dict[str, str] | None = None,
    ) -> Manifest:
        """One REST call; the decoded JSON answer, or a KubeError saying what went wrong."""
        path = kind.path(namespace, name)
        verb = _VERBS.get(method, "list" if name is None else "get")
        where = f" in namespace {namespace!r}" if kind.namespaced else " (cluster-scoped)"
        what = f"{verb} {kind.plural}" + (f" {name!r}" if name else "") + where
        try:
            serialized = self.api.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
            )
            method_, url, headers, data, post = serialized
            response = self.api.call_api(
                method_,
                url,
                header_params=headers,
                body=data,
                post_params=post,
                _request_timeout=REQUEST_TIMEOUT,
            )
            raw = response.read()
        except k8s_client.ApiException as exc:  # TLS problems arrive as status 0
            raise KubeUnavailableError(
                f"cannot reach the Kubernetes API at {self.host} to {what}: {exc.reason}; check "
                "the cluster's address and certificates in your kubeconfig"
            ) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailableError(
                f"cannot reach the Kubernetes API at {self.host} to {what}: {exc}. Is the cluster "
                "running, and is this the right kubeconfig/context (`kubectl cluster-info`)?"
            ) from exc
        status = int(response.status)
        if 200 <= status < 300:
            decoded = json.loads(raw) if raw else {}
            return decoded if isinstance(decoded, dict) else {"value": decoded}
        message = _server_message(raw)
        if status == 401:
            raise KubeForbiddenError(
                f"unauthorized: the Kubernetes API at {self.host} did not accept our credentials "
                f"to {what} ({message}); refresh them (log in again) or check --kubeconfig",
                status,
            )
        if status == 403:
            raise KubeForbiddenError(
                f"forbidden: the Kubernetes API refused to {what}: {message}. Ask a cluster "
                f"admin for a Role or ClusterRole that allows {verb} on {kind.plural}"
                + (f" in namespace {namespace!r}" if kind.namespaced else "")
                + " (docs/kubernetes.md lists what each elastic-run k8s command needs)",
                status,
            )
        if status == 404:
            raise KubeNotFoundError(f"not found: cannot {what}: {message}", status)
        if status == 409:
            raise KubeConflictError(f"conflict: cannot {what}: {message}", status)
        raise KubeError(f"the Kubernetes API failed to {what} (HTTP {status}): {message}", status)

    def get(self, kind: Kind, name: str, namespace: str | None) -> Manifest | None:
        """The object, or None if it does not exist."""
        try:
            return self.request("GET", kind, namespace, name)
        except KubeNotFoundError:
            return None

    def list(self, kind: Kind, namespace: str | None, selector: str) -> list[Manifest]:
        answer = self.request("GET", kind, namespace, query={"labelSelector": selector})
        items = answer.get("items") or []
        return [item for item in items if isinstance(item, dict)]

    def create(self, manifest: Manifest) -> Manifest:
        kind = kind_of(manifest)
        return self.request("POST", kind, manifest["metadata"].get("namespace"), body=manifest)

    def replace(self, manifest: Manifest) -> Manifest:
        """PUT ``manifest`` over the existing object, at the existing resourceVersion."""
        kind = kind_of(manifest)
        namespace, name = manifest["metadata"].get("namespace"), manifest["metadata"]["name"]
        current = self.request("GET", kind, namespace, name)
        body = {
            **manifest,
            "metadata": {
                **manifest["metadata"],
                "resourceVersion": current["metadata"]["resourceVersion"],
            },
        }
        return self.request("PUT", kind, namespace, name, body=body)

    def delete(self, kind: Kind, name: str, namespace: str | None) -> None:
        """Delete the object and (in the background) what it owns, such as a Job's pods."""
        self.request(
            "DELETE",
            kind,
            namespace,
            name,
            body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
        )
