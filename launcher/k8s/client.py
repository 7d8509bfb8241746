"""The one Kubernetes API client of elastic-allreduce, and the one way to make it.

:func:`connect` makes a :class:`Kube` from an explicit API URL (``--kube-api``: a ``kubectl
proxy``, tests), else from a kubeconfig (``--kubeconfig``, ``$KUBECONFIG`` or
``~/.kube/config``), else, inside a pod without one, from the pod's service account.

:class:`Kube` sends plain REST calls through the official client's ``ApiClient`` for the kinds
in :data:`KINDS` (no discovery round trips, no model classes: objects are the manifests' own
JSON dicts) and turns every failure into an error of :mod:`launcher.k8s.errors`:

- no usable configuration -> :class:`KubernetesConfigError` (a ConfigError);
- connection refused, DNS, TLS or timeout -> :class:`KubernetesUnavailableError` (an
  UnavailableError);
- 401 / 403 -> :class:`KubernetesForbiddenError`, naming the verb, resource and namespace and
  who can grant it (``rbac_advice``: a person running ``elastic-run k8s``, or the launcher), or,
  for a ResourceQuota's 403 ("exceeded quota"), that the namespace's quota is used up;
- 404 -> :class:`KubernetesNotFoundError`; 409 -> :class:`KubernetesConflictError`; anything
  else -> :class:`KubernetesApiError` with the server's message.

Every request has a timeout (``request_timeout``); a watch's read timeout outlasts its
server-side ``timeoutSeconds``. This module does not retry: :mod:`launcher.k8s.retry` does.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import kubernetes
import urllib3

from launcher.k8s.errors import (
    KubernetesApiError,
    KubernetesConfigError,
    KubernetesConflictError,
    KubernetesForbiddenError,
    KubernetesNotFoundError,
    KubernetesUnavailableError,
)

Manifest = dict[str, Any]
#: A list of objects (spelled so inside Kube, whose ``list`` method hides the builtin).
Manifests = list[Manifest]

# The client library's functions are untyped: reach them through Any, not ignore comments.
k8s_client: Any = kubernetes.client
k8s_config: Any = kubernetes.config

#: Seconds one API request may take (connect + read).
REQUEST_TIMEOUT: Final = 30.0
#: Seconds to connect for a watch, and how much longer than its server-side timeout the client
#: waits for the next bytes of a watch before it gives up on the connection.
WATCH_CONNECT_TIMEOUT: Final = 10.0
WATCH_READ_MARGIN: Final = 30.0

#: What to do about a 403, for a person running ``elastic-run k8s`` (format fields: verb,
#: resource, where).
USER_RBAC_ADVICE: Final = (
    "Ask a cluster admin for a Role or ClusterRole that allows {verb} on {resource}{where} "
    "(docs/kubernetes.md lists what each elastic-run k8s command needs)"
)
#: What to do about a 403, for the launcher in its pod.
LAUNCHER_RBAC_ADVICE: Final = (
    "The launcher's Role allows {verb} on {resource}: apply k8s/ (kubectl apply -k k8s/base) or "
    "`elastic-run k8s submit`, which create it, and run the launcher with that Role's service "
    "account"
)


@dataclass(frozen=True)
class Kind:
    """Where the API serves one kind of object."""

    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None) -> str:
        """The REST path of the collection, or of the object ``name`` (``name/status`` for
        its status subresource)."""
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced:
            if not namespace:
                raise KubernetesConfigError(f"{self.kind} is namespaced: a namespace is needed")
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
        Kind("v1", "Event", "events"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("batch/v1", "Job", "jobs"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("scheduling.k8s.io/v1", "PriorityClass", "priorityclasses", namespaced=False),
        Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims"),
        Kind(
            "admissionregistration.k8s.io/v1",
            "ValidatingAdmissionPolicy",
            "validatingadmissionpolicies",
            namespaced=False,
        ),
        Kind(
            "admissionregistration.k8s.io/v1",
            "ValidatingAdmissionPolicyBinding",
            "validatingadmissionpolicybindings",
            namespaced=False,
        ),
    )
}


def kind_of(manifest: Manifest) -> Kind:
    """The :class:`Kind` of a manifest; KubernetesConfigError for a kind not in KINDS."""
    kind = KINDS.get(str(manifest.get("kind")))
    if kind is None or kind.api_version != manifest.get("apiVersion"):
        raise KubernetesConfigError(
            f"cannot apply {manifest.get('apiVersion')}/{manifest.get('kind')}: elastic-run k8s "
            f"handles {', '.join(sorted(KINDS))}"
        )
    return kind


def connect(
    kubeconfig: str | None = None,
    context: str | None = None,
    url: str | None = None,
    *,
    rbac_advice: str = USER_RBAC_ADVICE,
    request_timeout: float = REQUEST_TIMEOUT,
) -> Kube:
    """The API client: for ``url`` when given (no credentials), else from a kubeconfig, else
    (inside a pod, without a kubeconfig) from the pod's service account. Each request may take
    ``request_timeout`` seconds."""
    if url:
        if not url.startswith(("http://", "https://")):
            raise KubernetesConfigError(
                f"invalid Kubernetes API URL {url!r}: give http://HOST:PORT or https://HOST:PORT "
                "(for example http://127.0.0.1:8001 for `kubectl proxy`)"
            )
        configuration = k8s_client.Configuration()
        configuration.host = url.rstrip("/")
        return Kube(
            k8s_client.ApiClient(configuration),
            rbac_advice=rbac_advice,
            request_timeout=request_timeout,
        )
    default = Path(os.path.expanduser(k8s_config.KUBE_CONFIG_DEFAULT_LOCATION))
    in_pod = "KUBERNETES_SERVICE_HOST" in os.environ and "KUBECONFIG" not in os.environ
    if kubeconfig is None and context is None and in_pod and not default.exists():
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException as exc:
            raise KubernetesConfigError(
                f"inside a pod, but its service account cannot be used: {exc}; mount a "
                "service account token or pass --kubeconfig"
            ) from exc
        return Kube(
            k8s_client.ApiClient(configuration),
            rbac_advice=rbac_advice,
            request_timeout=request_timeout,
        )
    source = kubeconfig or os.environ.get("KUBECONFIG") or str(default)
    try:
        api = k8s_config.new_client_from_config(
            config_file=kubeconfig, context=context, persist_config=False
        )
    except (k8s_config.ConfigException, OSError, ValueError, TypeError) as exc:
        raise KubernetesConfigError(
            f"no usable Kubernetes cluster configuration in {source}"
            + (f" (context {context!r})" if context else "")
            + f": {str(exc).rstrip('.')}. Point --kubeconfig or KUBECONFIG at a kubeconfig "
            "file (`kubectl config view` shows yours), or run inside a pod with a service account"
        ) from exc
    return Kube(api, rbac_advice=rbac_advice, request_timeout=request_timeout)


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


#: What the API server's 403 says when a ResourceQuota refuses a create (not RBAC).
QUOTA_REFUSAL: Final = "exceeded quota"

_VERBS: Final = {"POST": "create", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}
_JSON: Final = "application/json"
_MERGE_PATCH: Final = "application/merge-patch+json"


class _Response(Protocol):
    """The official client's (untyped) RESTResponse: the status, the body, and the urllib3
    response beneath, which a watch reads as a stream."""

    status: int
    response: urllib3.BaseHTTPResponse

    def read(self) -> bytes: ...


@dataclass(frozen=True)
class _Call:
    """One request, described for error messages."""

    verb: str
    kind: Kind
    namespace: str | None
    what: str


class Watch:
    """The events of one watch request, as dicts (``type``, ``object``), until the server ends
    it. :meth:`close` ends it at once from any thread; ``with`` releases the connection."""

    def __init__(self, response: urllib3.BaseHTTPResponse, call: _Call, host: str) -> None:
        self._response = response
        self._call = call
        self._host = host

    def __iter__(self) -> Iterator[Manifest]:
        pending = b""
        try:
            for chunk in self._response.stream(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield self._decode(line)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubernetesUnavailableError(
                f"lost the connection to the Kubernetes API at {self._host} while watching "
                f"{self._call.what}: {exc}"
            ) from exc

    def _decode(self, line: bytes) -> Manifest:
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise KubernetesApiError(
                f"malformed event in the watch of {self._call.what}: {line[:200]!r}"
            ) from exc
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise KubernetesApiError(
                f"malformed event in the watch of {self._call.what}: {event!r:.200}"
            )
        return event

    def close(self) -> None:
        """End the watch now (the iterating thread sees the stream end or fail)."""
        with contextlib.suppress(Exception):
            self._response.shutdown()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(Exception):
            self._response.release_conn()


class Kube:
    """Create, read, replace, patch, list, watch and delete objects of the kinds in KINDS."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        *,
        rbac_advice: str = USER_RBAC_ADVICE,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        # Typed Any: the client's methods are untyped.
        self.api: Any = api
        self.rbac_advice = rbac_advice
        #: Seconds one request (not a watch) may take, connect and read.
        self.request_timeout = request_timeout

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    def close(self) -> None:
        self.api.close()

    def __enter__(self) -> Kube:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------

    def _send(
        self,
        method: str,
        kind: Kind,
        namespace: str | None,
        name: str | None,
        *,
        body: object = None,
        query: dict[str, str] | None = None,
        content_type: str = _JSON,
        timeout: float | tuple[float, float] | None = None,
        verb: str | None = None,
    ) -> tuple[_Response, _Call]:
        """Send one request; the raw response (not yet read) or KubernetesUnavailableError."""
        path = kind.path(namespace, name)
        verb = verb or _VERBS.get(method, "list" if name is None else "get")
        where = f" in namespace {namespace!r}" if kind.namespaced else " (cluster-scoped)"
        what = f"{verb} {kind.plural}" + (f" {name!r}" if name else "") + where
        call = _Call(verb, kind, namespace, what)
        try:
            serialized = self.api.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((query or {}).items()),
                header_params={"Accept": _JSON, "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
            )
            method_, url, headers, data, post = serialized
            response: _Response = self.api.call_api(
                method_,
                url,
                header_params=headers,
                body=data,
                post_params=post,
                _request_timeout=self.request_timeout if timeout is None else timeout,
            )
        except k8s_client.ApiException as exc:  # TLS problems arrive as status 0
            raise KubernetesUnavailableError(
                f"cannot reach the Kubernetes API at {self.host} to {call.what}: {exc.reason}; "
                "check the cluster's address and certificates in your kubeconfig"
            ) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubernetesUnavailableError(
                f"cannot reach the Kubernetes API at {self.host} to {call.what}: {exc}. Is the "
                "cluster running, and is this the right kubeconfig/context or --kube-api "
                "(`kubectl cluster-info`)?"
            ) from exc
        return response, call

    def _read(self, response: _Response, call: _Call) -> bytes:
        try:
            return bytes(response.read())
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubernetesUnavailableError(
                f"lost the connection to the Kubernetes API at {self.host} to {call.what}: {exc}"
            ) from exc

    def _refusal(self, status: int, raw: bytes, call: _Call) -> KubernetesApiError:
        """The error for an answer that is not 2xx."""
        message = _server_message(raw)
        if status == 401:
            return KubernetesForbiddenError(
                f"unauthorized: the Kubernetes API at {self.host} did not accept our credentials "
                f"to {call.what} ({message}); refresh them (log in again), or check the "
                "kubeconfig or the pod's service account token",
                status,
            )
        if status == 403 and QUOTA_REFUSAL in message:
            return KubernetesForbiddenError(
                f"forbidden: the Kubernetes API refused to {call.what}: {message}. The "
                "namespace's ResourceQuota is used up: free it (fewer or smaller pods) or raise "
                "it (`kubectl describe resourcequota`)",
                status,
            )
        if status == 403:
            advice = self.rbac_advice.format(
                verb=call.verb,
                resource=call.kind.plural,
                where=f" in namespace {call.namespace!r}" if call.kind.namespaced else "",
            )
            return KubernetesForbiddenError(
                f"forbidden: the Kubernetes API refused to {call.what}: {message}. {advice}",
                status,
            )
        if status == 404:
            return KubernetesNotFoundError(
                f"not found: cannot {call.what}: {message} (HTTP 404)", status
            )
        if status == 409:
            return KubernetesConflictError(
                f"conflict: cannot {call.what}: {message} (HTTP 409)", status
            )
        return KubernetesApiError(
            f"the Kubernetes API failed to {call.what} (HTTP {status}): {message}", status
        )

    def request(
        self,
        method: str,
        kind: Kind,
        namespace: str | None,
        name: str | None = None,
        *,
        body: object = None,
        query: dict[str, str] | None = None,
        content_type: str = _JSON,
    ) -> Manifest:
        """One REST call; the decoded JSON answer, or a KubernetesApiError saying what failed."""
        response, call = self._send(
            method, kind, namespace, name, body=body, query=query, content_type=content_type
        )
        raw = self._read(response, call)
        status = int(response.status)
        if not 200 <= status < 300:
            raise self._refusal(status, raw, call)
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise KubernetesApiError(
                f"the Kubernetes API's answer to {call.what} is not JSON: {raw[:200]!r}"
            ) from exc
        return decoded if isinstance(decoded, dict) else {"value": decoded}

    def get(self, kind: Kind, name: str, namespace: str | None) -> Manifest | None:
        """The object, or None if it does not exist."""
        try:
            return self.request("GET", kind, namespace, name)
        except KubernetesNotFoundError:
            return None

    def list(self, kind: Kind, namespace: str | None, selector: str) -> Manifests:
        """The objects with labels matching ``selector`` ("" for all)."""
        return self.list_with_version(kind, namespace, selector)[0]

    def list_with_version(
        self, kind: Kind, namespace: str | None, selector: str
    ) -> tuple[Manifests, str]:
        """The matching objects and the list's resourceVersion (where a watch resumes)."""
        answer = self.request("GET", kind, namespace, query={"labelSelector": selector})
        items = answer.get("items") or []
        version = str((answer.get("metadata") or {}).get("resourceVersion") or "")
        return [item for item in items if isinstance(item, dict)], version

    def create(self, manifest: Manifest) -> Manifest:
        """Create the object (its namespace from ``metadata.namespace``); the stored object."""
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

    def patch(self, kind: Kind, name: str, namespace: str | None, patch: Manifest) -> Manifest:
        """Apply a JSON merge patch (RFC 7386) to the object."""
        return self.request("PATCH", kind, namespace, name, body=patch, content_type=_MERGE_PATCH)

    def delete(self, kind: Kind, name: str, namespace: str | None) -> None:
        """Delete the object and (in the background) what it owns, such as a Job's pods."""
        self.request(
            "DELETE",
            kind,
            namespace,
            name,
            body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
        )

    def watch(
        self,
        kind: Kind,
        namespace: str | None,
        selector: str,
        resource_version: str,
        timeout_seconds: int,
    ) -> Watch:
        """Watch matching objects from ``resource_version`` for up to ``timeout_seconds``
        (the server then ends the stream), with bookmarks."""
        query = {
            "labelSelector": selector,
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
        }
        response, call = self._send(
            "GET",
            kind,
            namespace,
            None,
            query=query,
            timeout=(WATCH_CONNECT_TIMEOUT, timeout_seconds + WATCH_READ_MARGIN),
            verb="watch",
        )
        status = int(response.status)
        if status != 200:
            raise self._refusal(status, self._read(response, call), call)
        return Watch(response.response, call, self.host)
