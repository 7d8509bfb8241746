"""Worker nodes as Kubernetes pods: the provisioner of the launcher's Kubernetes mode.

Each node is one pod named ``<job>-worker-<n>`` (n increasing; a name that already exists is
skipped), made from a Pod manifest (the worker template) whose first container runs
``elastic-run join``. The provisioner adds the job's labels, ``restartPolicy: Never`` (the
launcher replaces lost pods itself, within ``--max-restarts``), an ownerReference to the
launcher's pod (so the cluster garbage-collects the workers with it), and the environment the
agent reads: etcd endpoints, job id, node id (the pod's name) and host (the pod's IP).

A watch thread follows the job's pods (resuming from the last resourceVersion, re-listing after
410 Gone) and tells the launcher, through :meth:`KubernetesProvisioner.node_states`, which pods
the scheduler cannot place yet (Pending, Unschedulable) and which were lost without being asked
to stop: failed (the agent crashed or was killed), evicted, preempted, or deleted by someone
else. ``stop_node`` deletes the pod: the kubelet's SIGTERM is the agent's graceful leave, and
``terminationGracePeriodSeconds`` of the template bounds it.

Every call goes through the one API client (:class:`launcher.k8s.client.Kube`); its failures
are :class:`~launcher.k8s.errors.KubernetesApiError` (a ProvisionerError), and a worker template
that the API rejects is a :class:`~launcher.k8s.errors.KubernetesConfigError`.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from elastic_allreduce import env
from launcher.k8s.client import KINDS, Kube, Watch
from launcher.k8s.errors import (
    KubernetesApiError,
    KubernetesConfigError,
    KubernetesConflictError,
    KubernetesNotFoundError,
)
from launcher.k8s.naming import (
    GPU_RESOURCE,
    ROLE_WORKER,
    pod_labels,
    worker_pod_name,
    worker_selector,
)
from launcher.provisioners.api import NodeStates, Provisioner

log = logging.getLogger(__name__)

_MAX_NAME_ATTEMPTS: Final = 1000
_POD: Final = KINDS["Pod"]

Pod = dict[str, Any]


@dataclass(frozen=True)
class KubernetesSettings:
    """Where and how worker pods are made (one job)."""

    namespace: str
    job_id: str
    etcd: str
    #: A Pod manifest (``kind: Pod``) whose first container runs ``elastic-run join``.
    worker_template: Mapping[str, Any]
    #: The launcher's own pod: owner of the worker pods (None: no ownerReference).
    launcher_pod_name: str | None = None
    launcher_pod_uid: str | None = None
    #: GPUs per worker pod (sets the first container's nvidia.com/gpu limit; None: template's).
    gpus_per_node: int | None = None
    #: Seconds one watch request lasts on the server before it is renewed.
    watch_timeout: int = 60
    #: Seconds close() waits for the deleted pods to disappear.
    close_timeout: float = 60.0

    @property
    def selector(self) -> str:
        return worker_selector(self.job_id)


@dataclass
class _PodState:
    name: str
    created_here: bool
    #: The API has the pod (create returned or an event showed it): a re-list may judge it.
    confirmed: bool = False
    phase: str = "Pending"
    unschedulable: bool = False
    gone: bool = False
    disruption: str | None = None
    last: Pod = field(default_factory=dict)


class _WatchExpiredError(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


def describe_loss(pod: Pod, deleted: bool) -> str:
    """Why a pod was lost, in words (evicted, preempted, failed with an exit code, deleted)."""
    status = pod.get("status") or {}
    reasons = {
        c.get("reason")
        for c in status.get("conditions") or []
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
    }
    if status.get("reason") == "Evicted":
        return f"pod evicted ({status.get('message') or 'node pressure'})"
    if "PreemptionByScheduler" in reasons or "PreemptionByKubeScheduler" in reasons:
        return "pod preempted by the scheduler"
    if reasons:
        return f"pod disrupted ({', '.join(sorted(r for r in reasons if r))})"
    for item in status.get("containerStatuses") or []:
        terminated = (item.get("state") or {}).get("terminated")
        if terminated and status.get("phase") == "Failed":
            return (
                f"pod failed: container {item.get('name')} exited with code "
                f"{terminated.get('exitCode')} ({terminated.get('reason') or 'Error'})"
            )
    if status.get("phase") == "Failed":
        return f"pod failed ({status.get('reason') or status.get('message') or 'unknown'})"
    return "pod deleted" if deleted else "pod is being deleted"


class KubernetesProvisioner(Provisioner):
    """Runs each node as a pod (see the module docstring)."""

    def __init__(self, settings: KubernetesSettings, kube: Kube) -> None:
        _check_template(settings.worker_template)
        self.settings = settings
        self._kube = kube
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._pods: dict[str, _PodState] = {}
        self._stopping: set[str] = set()
        self._listeners: list[Callable[[], None]] = []
        self._resource_version: str | None = None
        self._stop = threading.Event()
        #: The open watch (closed by close() to end it at once).
        self._watch: Watch | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False
        #: The last error of the watch thread (for logs and tests); None after a success.
        self.watch_error: KubernetesApiError | None = None
        self.relists = 0

    # -- Provisioner -----------------------------------------------------------------------------

    def start_nodes(self, count: int) -> list[str]:
        self._ensure_watching()
        started = []
        for _ in range(count):
            started.append(self._create_pod())
        return started

    def stop_node(self, node_id: str) -> None:
        with self._lock:
            state = self._pods.get(node_id)
            if state is None or not state.created_here or state.gone:
                return
            self._stopping.add(node_id)
        self._delete(node_id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            names = [n for n, s in self._pods.items() if s.created_here and not s.gone]
            self._stopping.update(names)
        try:
            for name in names:
                self._delete(name)
            deadline = time.monotonic() + self.settings.close_timeout
            while names and time.monotonic() < deadline:
                with self._lock:
                    names = [n for n in names if not self._pods[n].gone]
                if names and not self._watch_alive():
                    names = self._still_there(names)
                if names:
                    self._stop.wait(0.2)
            if names:
                log.warning(
                    "[%s] worker pods still terminating after %.0f s: %s",
                    self.settings.job_id,
                    self.settings.close_timeout,
                    names,
                )
        finally:
            self._stop.set()
            with self._lock:
                watch = self._watch
            if watch is not None:
                watch.close()
            if self._watcher is not None:
                self._watcher.join(timeout=10)

    def node_states(self) -> NodeStates:
        with self._lock:
            return NodeStates(
                pending=frozenset(
                    n for n, s in self._pods.items() if s.unschedulable and not s.gone
                ),
                disrupted={n: s.disruption for n, s in self._pods.items() if s.disruption},
                dead=frozenset(
                    n for n, s in self._pods.items() if s.gone or s.phase in ("Failed", "Succeeded")
                ),
            )

    def subscribe(self, changed: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(changed)

    # -- pods --------------------------------------------------------------------------------------

    def worker_pod(self, name: str) -> Pod:
        """The worker pod ``name`` as it will be created from the template."""
        settings = self.settings
        pod: Pod = copy.deepcopy(dict(settings.worker_template))
        pod["apiVersion"] = "v1"
        pod["kind"] = "Pod"
        metadata = pod.setdefault("metadata", {})
        for server_side in ("name", "generateName", "uid", "resourceVersion", "namespace"):
            metadata.pop(server_side, None)
        metadata["name"] = name
        metadata["namespace"] = settings.namespace
        metadata["labels"] = {
            **(metadata.get("labels") or {}),
            **pod_labels(settings.job_id, ROLE_WORKER),
        }
        if settings.launcher_pod_name and settings.launcher_pod_uid:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": settings.launcher_pod_name,
                    "uid": settings.launcher_pod_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        spec = pod["spec"]
        spec["restartPolicy"] = "Never"
        container = spec["containers"][0]
        ours: dict[str, dict[str, Any]] = {
            env.ETCD_ENDPOINTS: {"value": settings.etcd},
            env.JOB_ID: {"value": settings.job_id},
            env.NODE_ID: {"valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            env.PROVISIONED: {"value": "1"},
            env.HOST: {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        }
        kept = [e for e in container.get("env") or [] if e.get("name") not in ours]
        container["env"] = kept + [{"name": k, **v} for k, v in ours.items()]
        if settings.gpus_per_node is not None:
            resources = container.setdefault("resources", {})
            resources.setdefault("limits", {})[GPU_RESOURCE] = settings.gpus_per_node
            resources.setdefault("requests", {})[GPU_RESOURCE] = settings.gpus_per_node
        for item in [*(spec.get("initContainers") or []), *spec["containers"]]:
            # Quantities are strings in the API's schema (YAML gives `nvidia.com/gpu: 1` as int).
            for part in ("limits", "requests"):
                amounts = (item.get("resources") or {}).get(part)
                if isinstance(amounts, dict):
                    amounts.update({k: str(v) for k, v in amounts.items()})
        return pod

    def _create_pod(self) -> str:
        settings = self.settings
        for _ in range(_MAX_NAME_ATTEMPTS):
            name = worker_pod_name(settings.job_id, next(self._numbers))
            with self._lock:
                if name in self._pods:
                    continue
                # Known before the create returns: the watch may report it first.
                self._pods[name] = _PodState(name, created_here=True)
            try:
                self._kube.create(self.worker_pod(name))
            except KubernetesConflictError:
                with self._lock:
                    del self._pods[name]
                log.info("[%s] pod %s already exists; trying the next name", settings.job_id, name)
                continue
            except KubernetesApiError as exc:
                with self._lock:
                    del self._pods[name]
                if exc.status in (400, 422):
                    raise KubernetesConfigError(
                        f"the worker template is not a valid Pod manifest: {exc}; fix the fields "
                        "named above (`kubectl apply --dry-run=server -f FILE` checks a manifest)"
                    ) from exc
                raise
            with self._lock:
                self._pods[name].confirmed = True
            log.info("[%s] created pod %s", settings.job_id, name)
            return name
        raise KubernetesApiError(
            f"could not find a free pod name for job {settings.job_id!r} in namespace "
            f"{settings.namespace!r} after {_MAX_NAME_ATTEMPTS} tries; delete old worker pods "
            f"(label {settings.selector})"
        )

    def _delete(self, name: str) -> None:
        try:
            self._kube.delete(_POD, name, self.settings.namespace)
        except KubernetesNotFoundError:
            with self._lock:
                self._pods[name].gone = True
            return
        log.info("[%s] deleted pod %s", self.settings.job_id, name)

    def _list(self) -> tuple[list[Pod], str]:
        return self._kube.list_with_version(_POD, self.settings.namespace, self.settings.selector)

    def _still_there(self, names: list[str]) -> list[str]:
        """Without a watch: which of ``names`` still exist (one list call)."""
        try:
            items, _ = self._list()
        except KubernetesApiError:
            return names
        present = {item["metadata"]["name"] for item in items}
        return [n for n in names if n in present]

    # -- the watch ---------------------------------------------------------------------------------

    def _ensure_watching(self) -> None:
        if self._watcher is not None:
            return
        self._relist()  # errors (RBAC, namespace) surface here, in the caller's thread
        self._watcher = threading.Thread(
            target=self._watch_loop, name=f"pods-{self.settings.job_id}", daemon=True
        )
        self._watcher.start()

    def _watch_alive(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def _relist(self) -> None:
        settings = self.settings
        try:
            items, version = self._list()
        except KubernetesNotFoundError as exc:
            raise KubernetesNotFoundError(
                f"{exc}; check --namespace {settings.namespace!r} and that the namespace exists",
                exc.status,
            ) from exc
        present = {item["metadata"]["name"]: item for item in items}
        with self._lock:
            self.relists += 1
            for name, pod in present.items():
                self._observe_locked(name, pod, deleted=False)
            for name, state in self._pods.items():
                if name not in present and not state.gone and state.confirmed:
                    self._observe_locked(name, state.last, deleted=True)
            self._resource_version = version
        self._notify()

    def _watch_loop(self) -> None:
        settings = self.settings
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if self._resource_version is None:
                    self._relist()
                self._watch_once()
                self.watch_error = None
                backoff = 0.5
                continue
            except _WatchExpiredError as exc:
                log.info("[%s] pod watch expired (%s); re-listing", settings.job_id, exc)
                self._resource_version = None
                continue
            except KubernetesApiError as exc:
                error = exc
            if self._stop.is_set():
                return
            self.watch_error = error
            log.warning("[%s] pod watch failed, retrying: %s", settings.job_id, error)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _watch_once(self) -> None:
        """One watch request from the last resourceVersion, until the server ends it.

        ADDED/MODIFIED/DELETED update the pods, BOOKMARK only the resourceVersion, an ERROR
        with code 410 means the version is too old (re-list), any other ERROR is a failure.
        """
        settings = self.settings
        watch = self._kube.watch(
            _POD,
            settings.namespace,
            settings.selector,
            self._resource_version or "",
            settings.watch_timeout,
        )
        with self._lock:
            self._watch = watch
        try:
            with watch:
                if self._stop.is_set():
                    return
                for event in watch:
                    self._on_watch_event(event)
        finally:
            with self._lock:
                self._watch = None

    def _on_watch_event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _WatchExpiredError(str(obj.get("message") or "410 Gone"))
            raise KubernetesApiError(
                f"the pod watch in namespace {self.settings.namespace!r} failed: "
                f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}",
                obj.get("code") if isinstance(obj.get("code"), int) else None,
            )
        metadata = obj.get("metadata") or {}
        with self._lock:
            if kind != "BOOKMARK":
                self._observe_locked(str(metadata.get("name", "")), obj, deleted=kind == "DELETED")
            if metadata.get("resourceVersion"):
                self._resource_version = str(metadata["resourceVersion"])
        if kind != "BOOKMARK":
            self._notify()

    def _observe_locked(self, name: str, pod: Pod, *, deleted: bool) -> None:
        state = self._pods.get(name)
        if state is None:
            # A pod of this job that this provisioner did not create (an earlier launcher's).
            state = self._pods[name] = _PodState(name, created_here=False)
        if state.gone:
            return
        state.confirmed = True
        state.last = pod
        status = pod.get("status") or {}
        state.phase = str(status.get("phase") or "Pending")
        # Not started yet: the scheduler cannot place it, or it is placed and its containers
        # wait (an image being pulled, volumes being mounted). Either way the node's start
        # timeout must not run, or a duplicate pod would be created every NODE_START_TIMEOUT.
        state.unschedulable = state.phase == "Pending" and (
            any(
                c.get("type") == "PodScheduled"
                and c.get("status") == "False"
                and c.get("reason") == "Unschedulable"
                for c in status.get("conditions") or []
            )
            or any(
                "waiting" in (c.get("state") or {}) for c in status.get("containerStatuses") or []
            )
        )
        terminating = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        if deleted:
            state.gone = True
            state.unschedulable = False
        lost = deleted or terminating or state.phase == "Failed"
        if (
            lost
            and state.created_here
            and state.disruption is None
            and name not in self._stopping
            and not self._closed
        ):
            state.disruption = describe_loss(pod, deleted)
            log.warning("[%s] node %s lost: %s", self.settings.job_id, name, state.disruption)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()


def _check_template(template: Mapping[str, Any]) -> None:
    """Refuse, before any pod is made, a worker template that is not a Pod with a container."""
    kind = template.get("kind", "Pod")
    spec = template.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if kind != "Pod" or not isinstance(containers, list) or not containers:
        raise KubernetesConfigError(
            "the worker template must be a Pod manifest (kind: Pod) with at least one container "
            f"in spec.containers, got kind {kind!r} with "
            f"{len(containers) if isinstance(containers, list) else 'no'} containers"
        )
    first = containers[0]
    if not isinstance(first, dict) or not (first.get("command") or first.get("args")):
        log.info(
            "the worker template's first container has no command: the image's entrypoint runs"
        )
