"""An in-process fake of the Kubernetes API server (and, optionally, of a one-node kubelet).

Only the Kubernetes API may be faked in this project (no real API server can run here), so this
fake follows the real server's semantics closely enough for the official ``kubernetes`` client:

- Generic object storage for core (``/api/v1/...``) and group (``/apis/G/V/...``) resources,
  namespaced and cluster-scoped; one global, increasing ``resourceVersion`` as etcd gives the
  real server; ``metadata.uid``, ``creationTimestamp``, ``generateName`` filled on create.
- Errors are real ``Status`` objects: 404 NotFound, 409 AlreadyExists (create) and 409 Conflict
  (stale ``resourceVersion`` in PUT or PATCH), 403 Forbidden (see :meth:`FakeKube.deny`, with
  RBAC's message or another, such as a ResourceQuota's), 422 Invalid, 415 for apply patches.
- Injected faults (:meth:`FakeKube.inject`, :class:`Fault`): the next requests of a verb on a
  resource are answered with an error status (500, 503, 429, ...), after a delay (a client's
  read timeout), by closing the connection without an answer, or after the request was served
  (a write whose answer was lost), as an API server, its load balancer or the network do.
- Watches (``?watch=true``) stream ADDED/MODIFIED/DELETED JSON lines with increasing
  resourceVersions and resume after a given ``resourceVersion``; after :meth:`FakeKube.compact`
  an older ``resourceVersion`` gets an ERROR event with a 410 ``Expired`` Status, as the real
  server's watch cache answers ("too old resource version").
- Deleting an owner deletes its dependents (background propagation of ``ownerReferences``).
- With ``run_pods=True`` it also plays scheduler and kubelet for one node of ``capacity`` pods:
  pods beyond capacity stay Pending (PodScheduled False, Unschedulable) until
  :meth:`FakeKube.set_capacity` raises it; a scheduled pod runs its first container's
  ``command`` + ``args`` as a local process with the container's env (``fieldRef`` resolved),
  phase Running, podIP 127.0.0.1. Exit makes it Succeeded or Failed (restartPolicy is treated as
  Never). DELETE sends SIGTERM, waits up to the grace period, then SIGKILLs the process group.
  :meth:`evict` (kubelet node-pressure eviction), :meth:`preempt` (scheduler preemption) and
  :meth:`kill` (the process dies of SIGKILL) reproduce what a cluster does in those cases.

Simplifications (documented, never silently different): strategic-merge patches are applied as
JSON merge patches (lists are replaced, not merged by key); label selectors support ``=``,
``==``, ``!=``, ``in``, ``notin``, ``k`` and ``!k``; field selectors support ``metadata.name``,
``metadata.namespace`` and ``status.phase``; no admission, no defaulting beyond what is listed.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import http.server
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes

from elastic_allreduce._process import die_with_parent
from launcher.k8s.client import LAUNCHER_RBAC_ADVICE, REQUEST_TIMEOUT, Kube, connect

Obj = dict[str, Any]
#: (API prefix such as "api/v1" or "apis/batch/v1", namespace or None, plural)
CollectionKey = tuple[str, "str | None", str]

_KINDS = {
    "pods": "Pod",
    "events": "Event",
    "namespaces": "Namespace",
    "services": "Service",
    "configmaps": "ConfigMap",
    "secrets": "Secret",
    "serviceaccounts": "ServiceAccount",
    "persistentvolumeclaims": "PersistentVolumeClaim",
    "nodes": "Node",
    "jobs": "Job",
    "deployments": "Deployment",
    "statefulsets": "StatefulSet",
    "roles": "Role",
    "rolebindings": "RoleBinding",
    "clusterroles": "ClusterRole",
    "clusterrolebindings": "ClusterRoleBinding",
    "leases": "Lease",
    "priorityclasses": "PriorityClass",
    "poddisruptionbudgets": "PodDisruptionBudget",
    "validatingadmissionpolicies": "ValidatingAdmissionPolicy",
    "validatingadmissionpolicybindings": "ValidatingAdmissionPolicyBinding",
}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
#: Exit code of a container killed by SIGKILL (128 + 9), as the kubelet reports it.
SIGKILL_EXIT_CODE = 128 + signal.SIGKILL
NODE_NAME = "fake-node"
POD_IP = "127.0.0.1"


class ApiError(Exception):
    """A request the fake answers with a ``Status`` error (code, reason, message)."""

    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> Obj:
        return status_object(self.code, self.reason, self.message, self.details)


def status_object(code: int, reason: str, message: str, details: dict[str, Any] | None) -> Obj:
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``null`` removes a key; lists and scalars replace)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json_patch(target: Obj, operations: list[Any]) -> Obj:  # noqa: PLR0912
    """RFC 6902 JSON patch (add, replace, remove, test)."""
    result = copy.deepcopy(target)
    for op in operations:
        parts = _pointer(op["path"])
        parent: Any = result
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise ApiError(422, "Invalid", f"test of {op['path']} failed")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last)
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON patch operation {kind!r}")
    return result


def _selector_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
            continue
        depth += {"(": 1, ")": -1}.get(char, 0)
        current += char
    if current.strip():
        terms.append(current.strip())
    return terms


def label_matches(labels: dict[str, str], selector: str | None) -> bool:  # noqa: PLR0911
    """Whether ``labels`` match a label selector string (``k=v,k!=v,k in (a,b),k,!k``)."""
    if not selector:
        return True
    for term in _selector_terms(selector):
        match = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term)
        if match:
            key, op, values = match.group(1), match.group(2), match.group(3)
            options = {v.strip() for v in values.split(",")}
            if (op == "in") != (labels.get(key) in options):
                return False
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_matches(obj: Obj, selector: str | None) -> bool:
    if not selector:
        return True
    for term in _selector_terms(selector):
        negate = "!=" in term
        path, value = (s.strip() for s in term.replace("==", "=").replace("!=", "=").split("=", 1))
        current: Any = obj
        for part in path.split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if (current == value) == negate:
            return False
    return True


@dataclass(frozen=True)
class Fault:
    """How the fake fails one request (:meth:`FakeKube.inject`)."""

    #: The answer: an error Status with this code (ignored when ``drop``).
    status: int = 500
    reason: str = "InternalError"
    message: str = "fake: an injected failure"
    #: Serve the request first (a write takes effect), then fail: the answer was lost.
    after_apply: bool = False
    #: Close the connection without any answer (a proxy's timeout, a network failure).
    drop: bool = False
    #: Seconds to wait before answering (beyond a client's read timeout: it times out).
    delay: float = 0.0


@dataclass
class _History:
    revision: int
    key: CollectionKey
    type: str
    obj: Obj


@dataclass(frozen=True)
class _WatchSpec:
    key: CollectionKey
    labels: str | None
    fields: str | None
    all_namespaces: bool
    generation: int


@dataclass
class _Container:
    """A pod's running first container (a local process group)."""

    namespace: str
    name: str
    uid: str
    popen: subprocess.Popen[bytes]
    logs: list[str] = field(default_factory=list)
    terminating: bool = False
    #: What the kubelet reports when the process is gone (evicted, preempted).
    outcome: dict[str, Any] = field(default_factory=dict)


class FakeKube:
    """The fake API server; use as a context manager or call :meth:`start` / :meth:`close`."""

    def __init__(
        self,
        *,
        run_pods: bool = False,
        capacity: int | None = None,
        namespaces: tuple[str, ...] = ("default", "kube-system"),
        workdir: str | Path | None = None,
        on_output: Callable[[str, str], None] | None = None,
    ) -> None:
        self.run_pods = run_pods
        self.capacity = capacity
        self.workdir = str(workdir or os.getcwd())
        #: Called with (pod name, line) for every line a pod's process prints.
        self.on_output = on_output
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._revision = 0
        self._compacted = 0
        self._objects: dict[CollectionKey, dict[str, Obj]] = {}
        self._history: list[_History] = []
        #: (verb, plural) -> the 403 message (None: RBAC's).
        self._denied: dict[tuple[str, str], str | None] = {}
        #: (verb, plural) -> faults for the next such requests, in order.
        self._faults: dict[tuple[str, str], list[Fault]] = {}
        #: Every fault used, as (verb, plural, fault), for tests that check what happened.
        self.faults_used: list[tuple[str, str, Fault]] = []
        self._watch_generation = 0
        self._closed = False
        self._containers: dict[str, _Container] = {}  # by pod uid
        self._logs: dict[tuple[str, str], list[str]] = {}
        self._kubelet: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._server: http.server.ThreadingHTTPServer | None = None
        #: Every request as (method, path with query), for tests that check what a client did.
        self.requests: list[tuple[str, str]] = []
        with self._lock:
            for namespace in namespaces:
                self._store_create(
                    ("api/v1", None, "namespaces"), {"metadata": {"name": namespace}}
                )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeKube:
        fake = self

        class Handler(_Handler):
            kube = fake

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        serving = threading.Thread(target=server.serve_forever, name="fake-kube-http", daemon=True)
        kubelet = threading.Thread(target=self._kubelet_loop, name="fake-kubelet", daemon=True)
        self._threads = [serving, kubelet]
        for thread in self._threads:
            thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None, "FakeKube.start() was not called"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        """Stop serving, end every watch and SIGKILL every pod process. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
            containers = list(self._containers.values())
        for container in containers:
            _killpg(container.popen, signal.SIGKILL)
        for container in containers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                container.popen.wait(timeout=10)
        self._kubelet.put(None)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def configuration(self) -> kubernetes.client.Configuration:
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        return configuration

    def api_client(self) -> kubernetes.client.ApiClient:
        """A client of the official library pointed at this fake (no credentials)."""
        return kubernetes.client.ApiClient(self.configuration())

    def kube(
        self, rbac_advice: str = LAUNCHER_RBAC_ADVICE, request_timeout: float = REQUEST_TIMEOUT
    ) -> Kube:
        """elastic-allreduce's own client pointed at this fake, as the launcher makes it."""
        return connect(url=self.url, rbac_advice=rbac_advice, request_timeout=request_timeout)

    # -- test knobs --------------------------------------------------------------------------

    def deny(self, verb: str, plural: str, message: str | None = None) -> None:
        """Answer ``verb`` (get, list, watch, create, update, patch, delete) on ``plural``
        with 403 Forbidden, as RBAC does when the Role lacks it (or with ``message``, as for
        example a ResourceQuota's admission says it: :func:`quota_message`)."""
        with self._lock:
            self._denied[(verb, plural)] = message

    def allow(self, verb: str, plural: str) -> None:
        with self._lock:
            self._denied.pop((verb, plural), None)

    def inject(self, verb: str, plural: str, *faults: Fault) -> None:
        """Fail the next requests of ``verb`` on ``plural``, one fault each, in order (after
        those injected before)."""
        with self._lock:
            self._faults.setdefault((verb, plural), []).extend(faults)

    def faults_left(self, verb: str, plural: str) -> int:
        with self._lock:
            return len(self._faults.get((verb, plural), []))

    def take_fault(self, method: str, path: str, query: dict[str, str]) -> Fault | None:
        """The fault for this request, if one is injected (used by the HTTP handler)."""
        try:
            key, name, _ = parse_path(path)
        except ApiError:
            return None
        verb = _verb(method, name, query)
        with self._lock:
            pending = self._faults.get((verb, key[2]))
            if not pending:
                return None
            fault = pending.pop(0)
            self.faults_used.append((verb, key[2], fault))
            return fault

    def compact(self) -> int:
        """Forget the watch history up to now: older resourceVersions get 410 Expired."""
        with self._lock:
            self._compacted = self._revision
            self._history.clear()
            return self._revision

    def drop_watches(self) -> None:
        """End every open watch stream cleanly, as the server does when a watch times out."""
        with self._lock:
            self._watch_generation += 1
            self._changed.notify_all()

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._revision

    def set_capacity(self, capacity: int | None) -> None:
        """How many pods the one node can run (None: unlimited); pending pods start if they fit."""
        with self._lock:
            self.capacity = capacity
        self._kubelet.put(self._schedule)

    def get(self, plural: str, name: str, namespace: str | None = "default") -> Obj | None:
        with self._lock:
            obj = self._collection(_prefix_of(plural), namespace, plural).get(name)
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, plural: str, namespace: str | None = "default") -> list[Obj]:
        with self._lock:
            found = self._matching(_prefix_of(plural), namespace, plural, None, None)
            return [copy.deepcopy(o) for o in found]

    def pod(self, name: str, namespace: str = "default") -> Obj | None:
        return self.get("pods", name, namespace)

    def pods(self, namespace: str = "default") -> list[Obj]:
        return self.objects("pods", namespace)

    def events(self, namespace: str = "default") -> list[Obj]:
        return self.objects("events", namespace)

    def logs(self, name: str, namespace: str = "default") -> list[str]:
        with self._lock:
            return list(self._logs.get((namespace, name), []))

    def pid(self, name: str, namespace: str = "default") -> int | None:
        """The pid of a running pod's process (None when it is not running)."""
        with self._lock:
            for container in self._containers.values():
                if container.name == name and container.namespace == namespace:
                    return container.popen.pid
        return None

    def wait_for(
        self, predicate: Callable[[], bool], timeout: float, what: str = "a condition"
    ) -> None:
        """Block until ``predicate()`` holds, re-checking whenever the store changes."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
                self._changed.wait(min(remaining, 0.5))

    def evict(self, name: str, namespace: str = "default") -> None:
        """Kubelet node-pressure eviction (hard threshold): the pod's processes are killed at
        once, and the pod stays as Failed with reason Evicted and a DisruptionTarget condition."""
        outcome = {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory. Threshold quantity: 100Mi, "
            "available: 50Mi.",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": "The node was low on resource: memory.",
                    "lastTransitionTime": _now(),
                }
            ],
        }
        self._disrupt(name, namespace, outcome, signal.SIGKILL)

    def preempt(self, name: str, namespace: str = "default") -> None:
        """Scheduler preemption: a DisruptionTarget condition (PreemptionByScheduler) is added,
        then the pod is deleted gracefully (SIGTERM, grace period, SIGKILL) and disappears."""
        with self._lock:
            pod = self._require(("api/v1", namespace, "pods"), name)
            updated = copy.deepcopy(pod)
            conditions = updated.setdefault("status", {}).setdefault("conditions", [])
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "PreemptionByScheduler",
                    "message": f"{NODE_NAME}: preempting to accommodate a higher priority pod",
                    "lastTransitionTime": _now(),
                }
            )
            self._store_replace(("api/v1", namespace, "pods"), updated)
            self._delete(("api/v1", namespace, "pods"), name, grace=None)

    def kill(self, name: str, namespace: str = "default") -> None:
        """The pod's processes die of SIGKILL (as an OOM kill or a crash of the node's runtime
        would do): Failed with exit code 137."""
        self._disrupt(name, namespace, {}, signal.SIGKILL)

    # -- storage (callers hold the lock) -------------------------------------------------------

    def _collection(self, prefix: str, namespace: str | None, plural: str) -> dict[str, Obj]:
        return self._objects.setdefault((prefix, namespace, plural), {})

    def _matching(
        self,
        prefix: str,
        namespace: str | None,
        plural: str,
        labels: str | None,
        fields: str | None,
        *,
        all_namespaces: bool = False,
    ) -> list[Obj]:
        found = []
        for (p, ns, pl), objects in self._objects.items():
            if p != prefix or pl != plural or (not all_namespaces and ns != namespace):
                continue
            for obj in objects.values():
                metadata = obj.get("metadata", {})
                if label_matches(metadata.get("labels") or {}, labels) and field_matches(
                    obj, fields
                ):
                    found.append(obj)
        found.sort(key=lambda o: int(o["metadata"]["resourceVersion"]))
        return found

    def _require(self, key: CollectionKey, name: str) -> Obj:
        obj = self._collection(*key).get(name)
        if obj is None:
            raise ApiError(
                404, "NotFound", f'{key[2]} "{name}" not found', {"name": name, "kind": key[2]}
            )
        return obj

    def _bump(self, key: CollectionKey, kind: str, obj: Obj) -> None:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        self._history.append(_History(self._revision, key, kind, copy.deepcopy(obj)))
        self._changed.notify_all()

    def _store_create(self, key: CollectionKey, body: Obj) -> Obj:
        prefix, namespace, plural = key
        if namespace is not None and namespace not in self._collection(
            "api/v1", None, "namespaces"
        ):
            raise ApiError(
                404,
                "NotFound",
                f'namespaces "{namespace}" not found',
                {"name": namespace, "kind": "namespaces"},
            )
        obj = copy.deepcopy(body)
        metadata = obj.setdefault("metadata", {})
        collection = self._collection(*key)
        if not metadata.get("name"):
            stem = metadata.get("generateName")
            if not stem:
                raise ApiError(
                    422, "Invalid", f"{plural}: metadata.name or generateName is required"
                )
            while True:
                name = stem + "".join(random.choices(_GENERATE_ALPHABET, k=5))
                if name not in collection:
                    break
            metadata["name"] = name
        name = metadata["name"]
        if not _NAME.match(name) and plural != "events":
            raise ApiError(
                422,
                "Invalid",
                f'{_KINDS.get(plural, plural)} "{name}" is invalid: metadata.name: Invalid value: '
                f'"{name}": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric '
                "characters, '-' or '.'",
            )
        if name in collection:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{plural} "{name}" already exists',
                {"name": name, "kind": plural},
            )
        if metadata.get("resourceVersion"):
            raise ApiError(422, "Invalid", "metadata.resourceVersion: must not be set for a create")
        if namespace is not None:
            metadata["namespace"] = namespace
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = _now()
        metadata.setdefault("generation", 1)
        obj.setdefault("apiVersion", prefix.split("/", 1)[1] if prefix != "api/v1" else "v1")
        obj.setdefault("kind", _KINDS.get(plural, plural[:-1].capitalize()))
        if plural == "pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            status = obj.setdefault("status", {})
            status.setdefault("phase", "Pending")
        if plural == "namespaces":
            obj.setdefault("status", {"phase": "Active"})
        collection[name] = obj
        self._bump(key, "ADDED", obj)
        return obj

    def _store_replace(self, key: CollectionKey, obj: Obj) -> Obj:
        self._collection(*key)[obj["metadata"]["name"]] = obj
        self._bump(key, "MODIFIED", obj)
        return obj

    def _update(
        self, key: CollectionKey, name: str, new: Obj, subresource: str | None, expected: str | None
    ) -> Obj:
        old = self._require(key, name)
        if expected and expected != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {key[2]} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
                {"name": name, "kind": key[2]},
            )
        if new.get("metadata", {}).get("name", name) != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the URL")
        if subresource == "status":
            updated = copy.deepcopy(old)
            updated["status"] = copy.deepcopy(new.get("status", {}))
        else:
            updated = copy.deepcopy(new)
            metadata = updated.setdefault("metadata", {})
            for fixed in ("uid", "creationTimestamp", "namespace", "deletionTimestamp"):
                if fixed in old["metadata"]:
                    metadata[fixed] = old["metadata"][fixed]
            metadata["name"] = name
            updated.setdefault("kind", old.get("kind"))
            updated.setdefault("apiVersion", old.get("apiVersion"))
            if "status" in old:
                updated["status"] = copy.deepcopy(old["status"])
            if updated.get("spec") != old.get("spec"):
                metadata["generation"] = int(old["metadata"].get("generation", 1)) + 1
        return self._store_replace(key, updated)

    def _delete(self, key: CollectionKey, name: str, grace: int | None) -> Obj:
        obj = self._require(key, name)
        if key[2] != "pods":
            return self._remove(key, obj)
        if obj["metadata"].get("deletionTimestamp"):
            return obj
        if grace is None:
            grace = int(obj.get("spec", {}).get("terminationGracePeriodSeconds", 30))
        container = self._containers.get(obj["metadata"]["uid"])
        if container is None or (grace <= 0 and not self.run_pods):
            if grace > 0 and obj.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                marked = copy.deepcopy(obj)
                marked["metadata"]["deletionTimestamp"] = _now()
                marked["metadata"]["deletionGracePeriodSeconds"] = grace
                self._store_replace(key, marked)
                obj = marked
            return self._remove(key, obj)
        marked = copy.deepcopy(obj)
        marked["metadata"]["deletionTimestamp"] = _now()
        marked["metadata"]["deletionGracePeriodSeconds"] = grace
        self._store_replace(key, marked)
        container.terminating = True
        if grace <= 0:
            _killpg(container.popen, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                container.popen.send_signal(signal.SIGTERM)
            self._kubelet.put(lambda: self._start_grace_timer(container, grace))
        return marked

    def _remove(self, key: CollectionKey, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        del self._collection(*key)[name]
        gone = copy.deepcopy(obj)
        self._bump(key, "DELETED", gone)
        uid = obj["metadata"]["uid"]
        self._kubelet.put(lambda: self._collect_dependents(uid))
        if key[2] == "pods":
            self._kubelet.put(self._schedule)
        return gone

    def _collect_dependents(self, owner_uid: str) -> None:
        """Garbage collection: delete every object with an ownerReference to ``owner_uid``."""
        with self._lock:
            dependents = [
                (key, obj["metadata"]["name"])
                for key, objects in self._objects.items()
                for obj in objects.values()
                if any(
                    ref.get("uid") == owner_uid
                    for ref in obj["metadata"].get("ownerReferences") or []
                )
            ]
            for key, name in dependents:
                with contextlib.suppress(ApiError):
                    self._delete(key, name, grace=None)

    # -- the kubelet ---------------------------------------------------------------------------

    def _kubelet_loop(self) -> None:
        """Runs scheduling, process starts and timers: processes are started from this one
        long-lived thread so that PR_SET_PDEATHSIG ties them to the fake, not to a request."""
        while True:
            work = self._kubelet.get()
            if work is None:
                return
            with self._lock:
                if self._closed:
                    continue
            work()

    def _start_grace_timer(self, container: _Container, grace: int) -> None:
        def expire() -> None:
            try:
                container.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _killpg(container.popen, signal.SIGKILL)

        threading.Thread(target=expire, name=f"grace-{container.name}", daemon=True).start()

    def _running_count(self) -> int:
        return sum(
            1
            for obj in self._matching("api/v1", None, "pods", None, None, all_namespaces=True)
            if obj.get("spec", {}).get("nodeName")
            and obj.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        )

    def _schedule(self) -> None:
        if not self.run_pods:
            return
        with self._lock:
            pending = [
                obj
                for obj in self._matching("api/v1", None, "pods", None, None, all_namespaces=True)
                if not obj.get("spec", {}).get("nodeName")
                and not obj["metadata"].get("deletionTimestamp")
                and obj.get("status", {}).get("phase") == "Pending"
            ]
            for pod in pending:
                key: CollectionKey = ("api/v1", pod["metadata"]["namespace"], "pods")
                if self.capacity is not None and self._running_count() >= self.capacity:
                    self._mark_unschedulable(key, pod)
                    continue
                self._bind_and_run(key, pod)

    def _mark_unschedulable(self, key: CollectionKey, pod: Obj) -> None:
        conditions = pod.get("status", {}).get("conditions") or []
        if any(c.get("type") == "PodScheduled" for c in conditions):
            return
        updated = copy.deepcopy(pod)
        updated["status"]["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient capacity. preemption: 0/1 "
                "nodes are available: 1 No preemption victims found for incoming pod.",
                "lastTransitionTime": _now(),
            }
        ]
        self._store_replace(key, updated)

    def _bind_and_run(self, key: CollectionKey, pod: Obj) -> None:
        updated = copy.deepcopy(pod)
        updated["spec"]["nodeName"] = NODE_NAME
        status = updated["status"]
        status["conditions"] = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}
        ]
        containers = updated["spec"].get("containers") or []
        if not containers:
            status.update(phase="Failed", reason="Invalid", message="the pod has no containers")
            self._store_replace(key, updated)
            return
        first = containers[0]
        argv = [str(a) for a in (first.get("command") or []) + (first.get("args") or [])]
        if not argv:
            status.update(
                phase="Failed",
                message="fake kubelet: the first container needs a command (no image entrypoint)",
            )
            self._store_replace(key, updated)
            return
        updated["status"].update(
            phase="Running",
            hostIP=POD_IP,
            podIP=POD_IP,
            podIPs=[{"ip": POD_IP}],
            startTime=_now(),
        )
        updated["status"]["conditions"].append(
            {"type": "Ready", "status": "True", "lastTransitionTime": _now()}
        )
        updated["status"]["containerStatuses"] = [
            {
                "name": first.get("name", "main"),
                "ready": True,
                "restartCount": 0,
                "image": first.get("image", ""),
                "imageID": "",
                "started": True,
                "state": {"running": {"startedAt": _now()}},
            }
        ]
        env = self._container_env(updated, first)
        argv[0] = _resolve_command(argv[0])
        try:
            popen = subprocess.Popen(
                argv,
                env=env,
                cwd=first.get("workingDir") or self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl
            )
        except OSError as exc:
            status.update(phase="Failed", message=f"fake kubelet: cannot start {argv}: {exc}")
            updated["status"]["containerStatuses"][0]["state"] = {
                "terminated": {"exitCode": 128, "reason": "StartError", "message": str(exc)}
            }
            self._store_replace(key, updated)
            return
        metadata = updated["metadata"]
        container = _Container(metadata["namespace"], metadata["name"], metadata["uid"], popen)
        self._containers[metadata["uid"]] = container
        self._logs[(container.namespace, container.name)] = container.logs
        self._store_replace(key, updated)
        threading.Thread(
            target=self._pump, args=(container,), name=f"pod-{container.name}", daemon=True
        ).start()

    def _container_env(self, pod: Obj, container: Obj) -> dict[str, str]:
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "metadata.uid": pod["metadata"]["uid"],
            "spec.nodeName": NODE_NAME,
            "status.podIP": POD_IP,
            "status.hostIP": POD_IP,
        }
        env = dict(os.environ)  # the "image": this machine's environment
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            ref = (item.get("valueFrom") or {}).get("fieldRef") or {}
            path = ref.get("fieldPath", "")
            labels = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
            if labels:
                env[item["name"]] = str(
                    pod["metadata"].get(labels.group(1), {}).get(labels.group(2), "")
                )
            elif path in fields:
                env[item["name"]] = fields[path]
        return env

    def _pump(self, container: _Container) -> None:
        stream = container.popen.stdout
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            container.logs.append(line)
            if self.on_output is not None:
                self.on_output(container.name, line)
        code = container.popen.wait()
        self._on_exit(container, code)

    def _on_exit(self, container: _Container, code: int) -> None:
        with self._lock:
            self._containers.pop(container.uid, None)
            if self._closed:
                return
            key: CollectionKey = ("api/v1", container.namespace, "pods")
            pod = self._collection(*key).get(container.name)
            if pod is None or pod["metadata"]["uid"] != container.uid:
                return
            exit_code = 128 - code if code < 0 else code
            updated = copy.deepcopy(pod)
            status = updated["status"]
            outcome = dict(container.outcome)
            conditions = outcome.pop("conditions", [])
            status["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            status.update(outcome)
            status["conditions"] = [
                c for c in status.get("conditions", []) if c.get("type") != "Ready"
            ] + [{"type": "Ready", "status": "False", "reason": "PodCompleted"}, *conditions]
            for item in status.get("containerStatuses", []):
                started = item.get("state", {}).get("running", {}).get("startedAt")
                item["ready"] = False
                item["started"] = False
                terminated: dict[str, Any] = {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": started,
                    "finishedAt": _now(),
                }
                if code < 0:
                    terminated["signal"] = -code
                item["state"] = {"terminated": terminated}
            self._store_replace(key, updated)
            if updated["metadata"].get("deletionTimestamp"):
                self._remove(key, updated)
            self._kubelet.put(self._schedule)

    def _disrupt(self, name: str, namespace: str, outcome: dict[str, Any], sig: int) -> None:
        with self._lock:
            pod = self._require(("api/v1", namespace, "pods"), name)
            container = self._containers.get(pod["metadata"]["uid"])
            if container is None:
                raise AssertionError(f"pod {name} has no running process to disrupt")
            container.outcome = outcome
            _killpg(container.popen, sig)

    # -- requests ------------------------------------------------------------------------------

    def handle(  # noqa: PLR0911, PLR0912
        self, method: str, path: str, query: dict[str, str], body: Any
    ) -> tuple[int, Any]:
        """Serve one non-watch request; returns (HTTP status, JSON body or text)."""
        key, name, subresource = parse_path(path)
        verb = _verb(method, name, query)
        if key[2] == "pods" and subresource == "log" and method == "GET":
            verb = "get"
        with self._lock:
            if (verb, key[2]) in self._denied:
                raise _forbidden(verb, key, self._denied[(verb, key[2])])
            if method == "GET" and subresource == "log":
                self._require(key, name or "")
                return 200, "\n".join(self._logs.get((key[1] or "", name or ""), [])) + "\n"
            if method == "GET" and name is None:
                items = self._matching(
                    key[0],
                    key[1],
                    key[2],
                    query.get("labelSelector"),
                    query.get("fieldSelector"),
                    all_namespaces=key[1] is None and key[2] not in _CLUSTER_SCOPED,
                )
                kind = _KINDS.get(key[2], key[2][:-1].capitalize())
                api_version = "v1" if key[0] == "api/v1" else key[0].split("/", 1)[1]
                return 200, {
                    "kind": f"{kind}List",
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(self._revision)},
                    "items": copy.deepcopy(items),
                }
            if method == "GET":
                return 200, copy.deepcopy(self._require(key, name or ""))
            if method == "POST":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the request body must be a JSON object")
                created = self._store_create(key, body)
                if key[2] == "pods":
                    self._kubelet.put(self._schedule)
                return 201, copy.deepcopy(created)
            if name is None:
                raise ApiError(405, "MethodNotAllowed", f"{method} needs an object name")
            if method == "PUT":
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the request body must be a JSON object")
                expected = body.get("metadata", {}).get("resourceVersion")
                return 200, copy.deepcopy(self._update(key, name, body, subresource, expected))
            if method == "PATCH":
                return 200, copy.deepcopy(self._patch(key, name, subresource, query, body))
            if method == "DELETE":
                grace = query.get("gracePeriodSeconds")
                options = body if isinstance(body, dict) else {}
                if grace is None and options.get("gracePeriodSeconds") is not None:
                    grace = str(options["gracePeriodSeconds"])
                propagation = options.get("propagationPolicy") or query.get("propagationPolicy")
                deleted = self._delete(key, name, None if grace is None else int(grace))
                if propagation == "Orphan":
                    self._orphan(deleted["metadata"]["uid"])
                if key[2] == "pods" or deleted["metadata"].get("deletionTimestamp"):
                    return 200, copy.deepcopy(deleted)
                return 200, status_object(
                    200,
                    "",
                    "",
                    {"name": name, "kind": key[2], "uid": deleted["metadata"]["uid"]},
                )
        raise ApiError(405, "MethodNotAllowed", f"method {method} is not supported")

    def _orphan(self, owner_uid: str) -> None:
        for objects in self._objects.values():
            for obj in objects.values():
                refs = obj["metadata"].get("ownerReferences") or []
                kept = [r for r in refs if r.get("uid") != owner_uid]
                if len(kept) != len(refs):
                    obj["metadata"]["ownerReferences"] = kept

    def _patch(
        self,
        key: CollectionKey,
        name: str,
        subresource: str | None,
        query: dict[str, str],
        patch: Any,
    ) -> Obj:
        content_type = query.get("__content_type", "")
        old = self._require(key, name)
        if "json-patch" in content_type:
            if not isinstance(patch, list):
                raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
            new = json_patch(old, patch)
            expected = None
        elif "merge-patch" in content_type:
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
            expected = (patch.get("metadata") or {}).get("resourceVersion")
            new = merge_patch(old, patch)
        else:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format: {content_type!r} "
                "(the fake supports json-patch, merge-patch and strategic-merge-patch)",
            )
        if subresource != "status":
            # Writes to the main resource cannot change status, as with the real server.
            new = dict(new)
            if "status" in old:
                new["status"] = old["status"]
            new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]
        return self._update(key, name, new, subresource, expected)

    def _expired(self, cursor: int) -> Obj:
        """The ERROR event the real server sends for a resourceVersion older than compaction."""
        message = f"too old resource version: {cursor} ({self._compacted})"
        return {"type": "ERROR", "object": status_object(410, "Expired", message, None)}

    def watch(self, path: str, query: dict[str, str]) -> Iterator[Obj]:
        """The events of a watch request, as the real server streams them (see module doc)."""
        key, name, _ = parse_path(path)
        with self._lock:
            if ("watch", key[2]) in self._denied:
                raise _forbidden("watch", key, self._denied[("watch", key[2])])
            generation = self._watch_generation
            labels, fields = query.get("labelSelector"), query.get("fieldSelector")
            if name is not None:
                fields = ",".join(filter(None, [fields, f"metadata.name={name}"]))
            all_namespaces = key[1] is None and key[2] not in _CLUSTER_SCOPED
            since = query.get("resourceVersion", "")
            initial: list[Obj] = []
            if since in ("", "0"):
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for o in self._matching(
                        key[0], key[1], key[2], labels, fields, all_namespaces=all_namespaces
                    )
                ]
                cursor = self._revision
            else:
                try:
                    cursor = int(since)
                except ValueError:
                    raise ApiError(
                        400, "BadRequest", f"invalid resourceVersion {since!r}"
                    ) from None
                if cursor < self._compacted:
                    initial = [self._expired(cursor)]
                    cursor = -1
        spec = _WatchSpec(key, labels, fields, all_namespaces, generation)
        return self._watch_stream(spec, initial, cursor, query)

    def _watch_stream(
        self, spec: _WatchSpec, initial: list[Obj], cursor: int, query: dict[str, str]
    ) -> Iterator[Obj]:
        key, labels, fields = spec.key, spec.labels, spec.fields
        all_namespaces, generation = spec.all_namespaces, spec.generation
        yield from initial
        if cursor < 0:
            return
        timeout = query.get("timeoutSeconds")
        deadline = time.monotonic() + float(timeout) if timeout else None

        def relevant(entry: _History) -> bool:
            prefix, namespace, plural = entry.key
            if prefix != key[0] or plural != key[2]:
                return False
            if not all_namespaces and namespace != key[1]:
                return False
            metadata = entry.obj.get("metadata", {})
            return label_matches(metadata.get("labels") or {}, labels) and field_matches(
                entry.obj, fields
            )

        while True:
            with self._lock:
                while True:
                    if self._closed or self._watch_generation != generation:
                        return
                    if deadline is not None and time.monotonic() >= deadline:
                        return
                    if cursor < self._compacted:
                        # Compacted while we were behind: the real server ends such a watch.
                        batch = [self._expired(cursor)]
                        cursor = -1
                        break
                    batch = [
                        {"type": e.type, "object": copy.deepcopy(e.obj)}
                        for e in self._history
                        if e.revision > cursor and relevant(e)
                    ]
                    if self._history and self._history[-1].revision > cursor:
                        cursor = self._history[-1].revision
                    if batch:
                        break
                    wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                    self._changed.wait(max(0.0, wait))
            yield from batch
            if cursor < 0:
                return


_CLUSTER_SCOPED = frozenset(
    {
        "namespaces",
        "nodes",
        "persistentvolumes",
        "clusterroles",
        "clusterrolebindings",
        "customresourcedefinitions",
        "priorityclasses",
        "storageclasses",
        "validatingadmissionpolicies",
        "validatingadmissionpolicybindings",
    }
)
_GROUP_OF = {
    "jobs": "apis/batch/v1",
    "deployments": "apis/apps/v1",
    "statefulsets": "apis/apps/v1",
    "roles": "apis/rbac.authorization.k8s.io/v1",
    "rolebindings": "apis/rbac.authorization.k8s.io/v1",
    "clusterroles": "apis/rbac.authorization.k8s.io/v1",
    "clusterrolebindings": "apis/rbac.authorization.k8s.io/v1",
    "leases": "apis/coordination.k8s.io/v1",
    "priorityclasses": "apis/scheduling.k8s.io/v1",
    "poddisruptionbudgets": "apis/policy/v1",
    "validatingadmissionpolicies": "apis/admissionregistration.k8s.io/v1",
    "validatingadmissionpolicybindings": "apis/admissionregistration.k8s.io/v1",
}


def _prefix_of(plural: str) -> str:
    return _GROUP_OF.get(plural, "api/v1")


def parse_path(path: str) -> tuple[CollectionKey, str | None, str | None]:
    """(collection, name, subresource) of a REST path; ApiError 404 if it is not one."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        prefix, rest = "api/v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        prefix, rest = "/".join(parts[:3]), parts[3:]
    else:
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({path})"
        )
    namespace: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({path})"
        )
    plural = rest[0]
    name = rest[1] if len(rest) >= 2 else None
    subresource = rest[2] if len(rest) == 3 else None
    return (prefix, namespace, plural), name, subresource


def _verb(method: str, name: str | None, query: dict[str, str]) -> str:
    if method == "GET":
        if query.get("watch") in ("true", "1", "True"):
            return "watch"
        return "list" if name is None else "get"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _forbidden(verb: str, key: CollectionKey, message: str | None = None) -> ApiError:
    prefix, namespace, plural = key
    group = "" if prefix == "api/v1" else prefix.split("/")[1]
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    return ApiError(
        403,
        "Forbidden",
        message
        or f'{plural} is forbidden: User "system:serviceaccount:default:fake" cannot {verb} '
        f'resource "{plural}" in API group "{group}"{where}',
        {"kind": plural},
    )


def quota_message(name: str = "worker", quota: str = "compute", used: int = 4) -> str:
    """What the API server's ResourceQuota admission says when a pod would exceed it."""
    return (
        f'pods "{name}" is forbidden: exceeded quota: {quota}, requested: pods=1, '
        f"used: pods={used}, limited: pods={used}"
    )


def _resolve_command(command: str) -> str:
    """Bare ``elastic-run`` / ``python`` mean this virtual environment's (the "image")."""
    if command == "elastic-run":
        return str(Path(sys.executable).parent / "elastic-run")
    if command in ("python", "python3"):
        return sys.executable
    return command


def _killpg(popen: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


class _Handler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive (the client pools connections); watches are chunked."""

    kube: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        self.kube.requests.append((method, self.path))
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            self._send(400, status_object(400, "BadRequest", "the body is not JSON", None))
            return
        query["__content_type"] = self.headers.get("Content-Type", "")
        fault = self.kube.take_fault(method, parts.path, query)
        if fault is not None:
            self._fail(fault, method, parts.path, query, body)
            return
        try:
            if method == "GET" and query.get("watch") in ("true", "1", "True"):
                self._stream(self.kube.watch(parts.path, query))
                return
            code, payload = self.kube.handle(method, parts.path, query, body)
        except ApiError as exc:
            self._send(exc.code, exc.status())
            return
        self._send(code, payload)

    def _fail(self, fault: Fault, method: str, path: str, query: dict[str, str], body: Any) -> None:
        """Answer the request as ``fault`` says."""
        if fault.delay:
            time.sleep(fault.delay)  # a slow server: the client's read timeout fires first
        if fault.after_apply:
            with contextlib.suppress(ApiError):
                self.kube.handle(method, path, query, body)
        if fault.drop:
            self.close_connection = True
            return
        self._send(fault.status, status_object(fault.status, fault.reason, fault.message, None))

    def _send(self, code: int, payload: Any) -> None:
        if isinstance(payload, str):
            data, content_type = payload.encode(), "text/plain"
        else:
            data, content_type = json.dumps(payload).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[Obj]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for event in events:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
