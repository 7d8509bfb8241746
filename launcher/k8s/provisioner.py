"""Worker nodes as Kubernetes pods: the provisioner of the launcher's Kubernetes mode.

Each node is one pod named ``<job>-worker-<n>`` (n increasing; a name that already exists is
skipped), made from a Pod manifest (the worker template) whose first container runs
``elastic-run join``. The provisioner adds the job's labels, ``restartPolicy: Never`` (the
launcher replaces lost pods itself, within ``--max-restarts``), an ownerReference (below), and
the environment the agent reads: etcd endpoints, job id, node id (the pod's name) and host (the
pod's IP).

**Owner.** The worker pods belong to the launcher's Job when the launcher runs in a pod of one
(``launcher_job_uid``): deleting the Job garbage-collects them, and a pod that replaces the
launcher's (after a crash, an eviction, a drain's handover) finds them still running and adopts
them. The reference is not a controller reference (the Job controller would release pods that
its selector does not match) and does not block the owner's deletion (that needs rights on the
Job's finalizers). A launcher pod written by hand (no Job) owns them itself, as a controller:
they go with that pod. Without either, pods have no owner.

**Adoption.** Pods of the job that carry this launcher's owner reference and that this
provisioner did not create (an earlier launcher pod of the same Job made them) are its own as
soon as it sees them: their losses are reported, ``stop_node`` deletes them and ``close`` too.
It starts watching when the launcher subscribes (which a launcher does when it starts to lead),
so it adopts a running job's pods before it starts any. A pod already dead when first seen is
taken only to be cleaned up at the end, not reported as a loss (the launcher before handled it).

A watch thread follows the job's pods (resuming from the last resourceVersion, re-listing after
410 Gone) and tells the launcher, through :meth:`KubernetesProvisioner.node_states`, which pods
the scheduler cannot place yet (Pending, Unschedulable, or not created yet: below) and which
were lost without being asked to stop: failed (the agent crashed or was killed), evicted,
preempted, or deleted by someone else. ``stop_node`` deletes the pod: the kubelet's SIGTERM is
the agent's graceful leave, and ``terminationGracePeriodSeconds`` of the template bounds it.

**API failures are weather** (:mod:`launcher.k8s.retry`). A create or delete that fails
transiently (no answer, a timeout, 429, 5xx) or that the API refuses with 401/403 (an exceeded
ResourceQuota, RBAC) does not hold up the launcher: ``start_nodes`` returns the node at once and
reports it pending, and a retry thread creates it later, with backoff and jitter; a transient
failure is retried up to ``api_deadline`` seconds (the job's ``--outage-timeout``), after which
the node is reported lost; a refusal is retried until it succeeds or the node is stopped (a
quota may free up). Each kind of problem is logged once, and once more when it is over. A
create whose answer was lost may have been applied: each pod carries a creation token (an
annotation), so a later 409 for a pod holding this attempt's token is this create's success,
not a taken name.
The watch retries every failure with jittered backoff. Only what a retry cannot change fails
at once: a worker template the API rejects (400/422:
:class:`~launcher.k8s.errors.KubernetesConfigError`), a missing namespace (404), or RBAC/404
refusing the first list of the pods.

Every call goes through the one API client (:class:`launcher.k8s.client.Kube`); its failures
are :class:`~launcher.k8s.errors.KubernetesApiError` (a ProvisionerError).
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from elastic_allreduce import env
from elastic_allreduce.records.values import MemberRecord
from launcher.k8s.client import KINDS, Kube, Watch
from launcher.k8s.errors import (
    KubernetesApiError,
    KubernetesConfigError,
    KubernetesConflictError,
    KubernetesForbiddenError,
    KubernetesNotFoundError,
)
from launcher.k8s.naming import (
    CREATION_ANNOTATION,
    GPU_RESOURCE,
    ROLE_WORKER,
    pod_labels,
    worker_pod_name,
    worker_selector,
)
from launcher.k8s.retry import (
    REFUSED_BACKOFF,
    TRANSIENT_BACKOFF,
    Backoff,
    Reports,
    is_transient,
    retrying,
)
from launcher.provisioners.api import NodeStates, Provisioner

log = logging.getLogger(__name__)

_MAX_NAME_ATTEMPTS: Final = 1000
_POD: Final = KINDS["Pod"]
#: Seconds the retry thread waits when nothing is due (it is woken when work arrives).
_IDLE_WAIT: Final = 1.0

Pod = dict[str, Any]


@dataclass(frozen=True)
class KubernetesSettings:
    """Where and how worker pods are made (one job)."""

    namespace: str
    job_id: str
    etcd: str
    #: A Pod manifest (``kind: Pod``) whose first container runs ``elastic-run join``.
    worker_template: Mapping[str, Any]
    #: The launcher's own pod: owner of the worker pods when it has no Job (None: no owner).
    launcher_pod_name: str | None = None
    launcher_pod_uid: str | None = None
    #: The Job that runs the launcher's pod: owner of the worker pods (None: the pod owns them).
    launcher_job_name: str | None = None
    launcher_job_uid: str | None = None
    #: GPUs per worker pod (sets the first container's nvidia.com/gpu limit; None: template's).
    gpus_per_node: int | None = None
    #: Seconds one watch request lasts on the server before it is renewed.
    watch_timeout: int = 60
    #: Seconds close() waits for the deleted pods to disappear.
    close_timeout: float = 60.0
    #: Seconds a create or delete is retried through transient API failures (the job's
    #: --outage-timeout) before the node is given up.
    api_deadline: float = 300.0
    #: Delays between retries after a transient failure.
    retry_backoff: Backoff = TRANSIENT_BACKOFF
    #: Delays between creates the API refuses (401/403: an exceeded quota, RBAC).
    refused_backoff: Backoff = REFUSED_BACKOFF

    @property
    def selector(self) -> str:
        return worker_selector(self.job_id)

    @property
    def owner_reference(self) -> dict[str, Any] | None:
        """The worker pods' ownerReference: the launcher's Job, else its pod, else none."""
        if self.launcher_job_name and self.launcher_job_uid:
            # Not a controller reference (the Job controller would release a pod its selector
            # does not match) and not blocking the Job's deletion (that needs update on
            # jobs/finalizers under the OwnerReferencesPermissionEnforcement admission plugin).
            return {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": self.launcher_job_name,
                "uid": self.launcher_job_uid,
            }
        if self.launcher_pod_name and self.launcher_pod_uid:
            return {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": self.launcher_pod_name,
                "uid": self.launcher_pod_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        return None

    @property
    def owner_uid(self) -> str | None:
        """The uid in the worker pods' ownerReference: pods carrying it are this job's
        launcher's (adopted by a launcher pod that replaces another)."""
        owner = self.owner_reference
        return None if owner is None else str(owner["uid"])


@dataclass
class _PodState:
    name: str
    #: This provisioner's to manage (created here, or adopted): its losses are reported,
    #: stop_node and close delete it.
    owned: bool
    #: The API has the pod (create returned or an event showed it): a re-list may judge it.
    confirmed: bool = False
    #: Not created yet: its create failed (transiently, or refused) and is being retried.
    deferred: bool = False
    phase: str = "Pending"
    unschedulable: bool = False
    gone: bool = False
    disruption: str | None = None
    #: Whether a loss is reported (not for a pod that was already dead when it was adopted).
    report_losses: bool = True
    #: The creation token this provisioner put on the pod ("" for an adopted pod).
    token: str = ""
    last: Pod = field(default_factory=dict)


@dataclass
class _Retry:
    """A create or delete of one pod that failed and is tried again by the retry thread."""

    operation: str  # "create" or "delete"
    since: float
    delays: Iterator[float]
    next_try: float
    #: An earlier create attempt may have been applied (its answer was lost).
    ambiguous: bool = False
    #: The last attempt was refused (401/403), not a transient failure: the delays are the
    #: refused ones (``KubernetesSettings.refused_backoff``).
    refused: bool = False


class _WatchExpiredError(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


#: What a pod's ``DisruptionTarget`` condition says, by its reason (the scheduler's before
#: Kubernetes 1.27 and since; the API server's Eviction subresource, for a drain or the cluster
#: autoscaler).
_DISRUPTIONS: Final = {
    "PreemptionByScheduler": "pod preempted by the scheduler",
    "PreemptionByKubeScheduler": "pod preempted by the scheduler",
    "EvictionByEvictionAPI": "pod evicted through the Eviction API (a drain or the cluster "
    "autoscaler)",
}


def describe_loss(pod: Pod, deleted: bool) -> str:
    """Why a pod was lost, in words (evicted, preempted, failed with an exit code, deleted)."""
    status = pod.get("status") or {}
    reasons = sorted(
        str(c.get("reason") or "")
        for c in status.get("conditions") or []
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
    )
    if status.get("reason") == "Evicted":
        return f"pod evicted ({status.get('message') or 'node pressure'})"
    known = [words for reason, words in _DISRUPTIONS.items() if reason in reasons]
    if known or reasons:
        return known[0] if known else f"pod disrupted ({', '.join(r for r in reasons if r)})"
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
        #: Creates and deletes that failed, by pod name, and the thread that retries them.
        self._retries: dict[str, _Retry] = {}
        self._retry_due = threading.Event()
        self._retry_stop = threading.Event()
        self._retrier: threading.Thread | None = None
        self._closed = False
        self._reports = Reports(log, f"[{settings.job_id}]")
        #: The last error of the watch thread (for logs and tests); None after a success.
        self.watch_error: KubernetesApiError | None = None
        self.relists = 0

    # -- Provisioner -----------------------------------------------------------------------------

    def start_nodes(self, count: int) -> list[str]:
        self._ensure_watching()
        started: list[str] = []
        for _ in range(_MAX_NAME_ATTEMPTS):
            if len(started) == count:
                return started
            name = self._reserve_name()
            if self._first_create(name):
                started.append(name)
        raise KubernetesApiError(
            f"could not find a free pod name for job {self.settings.job_id!r} in namespace "
            f"{self.settings.namespace!r} after {_MAX_NAME_ATTEMPTS} tries; delete old worker "
            f"pods (label {self.settings.selector})"
        )

    def adopt(self, members: Mapping[str, MemberRecord]) -> frozenset[str]:
        """The pods of ``members`` that an earlier launcher pod of this Job created (its owner
        reference, seen by the first list of the job's pods): managed as this one's own. A
        pod the list did not show yet (the API away) stays a node that joined by itself."""
        self._ensure_watching()
        with self._lock:
            return frozenset(
                node
                for node in members
                if (state := self._pods.get(node)) is not None and state.owned and not state.gone
            )

    def stop_node(self, node_id: str) -> None:
        with self._lock:
            state = self._pods.get(node_id)
            if state is None or not state.owned or state.gone:
                return
            self._stopping.add(node_id)
            deferred = state.deferred
            if deferred:
                # Not created, or maybe (a create whose answer was lost): then delete it.
                state.deferred = False
                retry = self._retries.pop(node_id, None)
                if retry is not None and retry.ambiguous:
                    self._schedule_locked(node_id, "delete")
                else:
                    state.gone = True
        if deferred:
            self._notify()
            return
        self._delete_or_retry(node_id)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_retrying()  # joined: no create or delete of the retry thread is under way
        with self._lock:
            names = [n for n, s in self._pods.items() if s.owned and not s.gone]
            for name in names:
                state = self._pods[name]
                retry = self._retries.pop(name, None)
                if state.deferred and (retry is None or not retry.ambiguous):
                    state.gone = True  # never created
            self._retries.clear()
            names = [n for n in names if not self._pods[n].gone]
            self._stopping.update(names)
        deadline = time.monotonic() + self.settings.close_timeout
        try:
            for name in names:
                self._delete_before(name, deadline)
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
            self._stop_watching()

    def release(self) -> None:
        """Stop watching but leave every worker pod running: the launcher hands the job over,
        and the next launcher adopts the pods' nodes (creates still being retried are dropped:
        the next launcher counts what exists)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_retrying()
        with self._lock:
            self._retries.clear()
        self._stop_watching()

    def node_states(self) -> NodeStates:
        with self._lock:
            return NodeStates(
                pending=frozenset(
                    n
                    for n, s in self._pods.items()
                    if (s.unschedulable or s.deferred) and not s.gone
                ),
                disrupted={n: s.disruption for n, s in self._pods.items() if s.disruption},
                dead=frozenset(
                    n for n, s in self._pods.items() if s.gone or s.phase in ("Failed", "Succeeded")
                ),
            )

    def subscribe(self, changed: Callable[[], None]) -> None:
        """Call ``changed`` when node states change; the launcher subscribes as it starts to
        lead, so the pods are watched from then on (and those an earlier launcher of the same
        Job started are adopted) even before this launcher starts a node."""
        with self._lock:
            self._listeners.append(changed)
        self._ensure_watching()

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
        owner = settings.owner_reference
        if owner is not None:
            metadata["ownerReferences"] = [owner]
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

    def _reserve_name(self) -> str:
        """The next name no pod of the job has (as far as this provisioner knows), recorded as
        this provisioner's pod with a fresh creation token."""
        with self._lock:
            while True:
                name = worker_pod_name(self.settings.job_id, next(self._numbers))
                if name not in self._pods:
                    # Known before the create returns: the watch may report it first.
                    self._pods[name] = _PodState(name, owned=True, token=uuid.uuid4().hex)
                    return name

    def _create(self, name: str, ambiguous: bool) -> bool:
        """One create of pod ``name``: True if it exists now as this provisioner's, False if
        the name is taken by another pod. A 409 after an ``ambiguous`` attempt (one whose
        answer was lost) is this create's if the pod holds this attempt's token."""
        with self._lock:
            token = self._pods[name].token
        pod = self.worker_pod(name)
        pod["metadata"].setdefault("annotations", {})[CREATION_ANNOTATION] = token
        try:
            self._kube.create(pod)
        except KubernetesConflictError:
            if not ambiguous:
                return False
            existing = self._kube.get(_POD, name, self.settings.namespace)
            annotations = ((existing or {}).get("metadata") or {}).get("annotations") or {}
            if annotations.get(CREATION_ANNOTATION) != token:
                return False
        with self._lock:
            state = self._pods[name]
            state.confirmed = True
            state.deferred = False
        log.info("[%s] created pod %s", self.settings.job_id, name)
        return True

    def _first_create(self, name: str) -> bool:
        """Create ``name`` from start_nodes: True if it exists or will be retried (the node
        is started, as far as the launcher is concerned); False if the name is taken."""
        settings = self.settings
        try:
            created = self._create(name, ambiguous=False)
        except KubernetesApiError as exc:
            if is_transient(exc) or isinstance(exc, KubernetesForbiddenError):
                self._defer(name, exc)
                return True
            with self._lock:
                del self._pods[name]
            if exc.status in (400, 422):
                raise KubernetesConfigError(
                    f"the worker template is not a valid Pod manifest: {exc}; fix the fields "
                    "named above (`kubectl apply --dry-run=server -f FILE` checks a manifest)"
                ) from exc
            raise
        if not created:
            with self._lock:
                del self._pods[name]
            log.info("[%s] pod %s already exists; trying the next name", settings.job_id, name)
            return False
        self._create_works()
        return True

    def _create_works(self) -> None:
        self._reports.over("create-refused", "creating worker pods is allowed again")
        self._reports.over("create-failed", "creating worker pods works again")

    def _defer(self, name: str, error: KubernetesApiError) -> None:
        """Retry the create of ``name`` later; say why (once per kind of problem)."""
        refused = isinstance(error, KubernetesForbiddenError)
        with self._lock:
            self._pods[name].deferred = True
            self._schedule_locked(name, "create", ambiguous=not refused)
        self._report_create_failure(error)
        self._notify()

    def _report_create_failure(self, error: KubernetesApiError) -> None:
        if isinstance(error, KubernetesForbiddenError):
            self._reports.problem(
                "create-refused",
                f"cannot create worker pods: {error}. The job goes on with the nodes it has; "
                "the pods are created when the API allows it (retried with backoff up to "
                f"{self.settings.refused_backoff.cap:.0f} s apart)",
            )
        else:
            self._reports.problem(
                "create-failed",
                f"creating a worker pod failed, retrying for up to "
                f"{self.settings.api_deadline:.0f} s: {error}",
            )

    def _delete_or_retry(self, name: str) -> None:
        """Delete pod ``name`` (stop_node); a failure is retried by the retry thread."""
        try:
            self._delete(name)
        except KubernetesApiError as exc:
            if not (is_transient(exc) or isinstance(exc, KubernetesForbiddenError)):
                raise
            self._reports.problem(
                "delete",
                f"deleting pod {name} failed, retrying for up to "
                f"{self.settings.api_deadline:.0f} s: {exc}",
            )
            with self._lock:
                self._schedule_locked(name, "delete")

    def _delete_before(self, name: str, deadline: float) -> None:
        """Delete pod ``name`` for close(), retrying transient failures until ``deadline``."""
        remaining = deadline - time.monotonic()
        try:
            retrying(
                lambda: self._delete(name),
                what=f"delete pod {name!r} in namespace {self.settings.namespace!r}",
                deadline=max(0.0, remaining),
                backoff=self.settings.retry_backoff,
            )
        except KubernetesApiError as exc:
            log.warning(
                "[%s] could not delete worker pod %s: %s; delete it with `kubectl -n %s "
                "delete pod %s`",
                self.settings.job_id,
                name,
                exc,
                self.settings.namespace,
                name,
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

    # -- retries -----------------------------------------------------------------------------------

    def _schedule_locked(self, name: str, operation: str, *, ambiguous: bool = False) -> None:
        """Have the retry thread try ``operation`` on ``name`` (the lock is held)."""
        settings = self.settings
        refused = operation == "create" and not ambiguous
        delays = (settings.refused_backoff if refused else settings.retry_backoff).delays()
        now = time.monotonic()
        earlier = self._retries.get(name)
        self._retries[name] = _Retry(
            operation,
            earlier.since if earlier is not None else now,
            delays,
            now + next(delays),
            ambiguous=ambiguous or (earlier is not None and earlier.ambiguous),
            refused=refused,
        )
        if self._retrier is None and not self._closed:
            self._retrier = threading.Thread(
                target=self._retry_loop, name=f"pod-retries-{settings.job_id}", daemon=True
            )
            self._retrier.start()
        self._retry_due.set()

    def _retry_loop(self) -> None:
        while not self._retry_stop.is_set():
            now = time.monotonic()
            with self._lock:
                due = [(n, r) for n, r in self._retries.items() if r.next_try <= now]
                soonest = min((r.next_try for r in self._retries.values()), default=None)
            for name, retry in due:
                if self._retry_stop.is_set():
                    return
                self._retry_once(name, retry)
            if not due:
                wait = _IDLE_WAIT if soonest is None else max(0.0, soonest - now)
                self._retry_due.wait(min(wait, _IDLE_WAIT))
                self._retry_due.clear()

    def _retry_once(self, name: str, retry: _Retry) -> None:
        with self._lock:
            state = self._pods.get(name)
            if self._retries.get(name) is not retry or state is None:
                return
            if retry.operation == "create" and (state.gone or state.confirmed):
                del self._retries[name]  # stopped, or the watch saw it (an ambiguous create took)
                return
        try:
            if retry.operation == "create":
                created = self._create(name, retry.ambiguous)
            else:
                self._delete(name)
                created = True
        except KubernetesApiError as exc:
            self._retry_failed(name, retry, exc)
            return
        with self._lock:
            if self._retries.get(name) is retry:
                del self._retries[name]
            cancelled = retry.operation == "create" and name in self._stopping
            if retry.operation == "create" and not created:
                state.gone = True
                state.deferred = False
                state.disruption = "its pod name was taken by another pod"
            elif cancelled:
                self._schedule_locked(name, "delete")
        if retry.operation == "create":
            self._create_works()
        else:
            self._reports.over("delete", "deleting worker pods works again")
        self._notify()

    def _retry_failed(self, name: str, retry: _Retry, error: KubernetesApiError) -> None:
        settings = self.settings
        with self._lock:
            if self._retries.get(name) is not retry:
                return  # settled meanwhile: the watch saw the pod, or it was stopped
        refused = isinstance(error, KubernetesForbiddenError)
        permanent = not (is_transient(error) or refused)
        elapsed = time.monotonic() - retry.since
        # A refused create waits for the quota as long as the job wants the node; everything
        # else gives up after the deadline.
        expired = elapsed > settings.api_deadline and not (refused and retry.operation == "create")
        if permanent or expired:
            with self._lock:
                if self._retries.get(name) is retry:
                    del self._retries[name]
                state = self._pods[name]
                if retry.operation == "create":
                    state.gone = True
                    state.deferred = False
                    state.disruption = f"its pod could not be created for {elapsed:.0f} s: {error}"
            log.error(
                "[%s] gave up trying to %s pod %s after %.0f s: %s%s",
                settings.job_id,
                retry.operation,
                name,
                elapsed,
                error,
                f"; delete it with `kubectl -n {settings.namespace} delete pod {name}`"
                if retry.operation == "delete"
                else "",
            )
            self._notify()
            return
        if retry.operation == "create":
            retry.ambiguous = retry.ambiguous or not refused
            self._report_create_failure(error)
            if refused != retry.refused:
                # Another kind of failure: its own pace (a quota's or a flaky server's).
                retry.refused = refused
                backoff = settings.refused_backoff if refused else settings.retry_backoff
                retry.delays = backoff.delays()
        else:
            self._reports.problem(
                "delete",
                f"deleting pod {name} failed, retrying for up to {settings.api_deadline:.0f} s: "
                f"{error}",
            )
        with self._lock:
            retry.next_try = time.monotonic() + next(retry.delays)

    def _stop_retrying(self) -> None:
        self._retry_stop.set()
        self._retry_due.set()
        if self._retrier is not None and self._retrier is not threading.current_thread():
            self._retrier.join(timeout=10)

    # -- the watch ---------------------------------------------------------------------------------

    def _ensure_watching(self) -> None:
        with self._lock:
            if self._watcher is not None or self._closed:
                return
            self._watcher = threading.Thread(
                target=self._watch_loop, name=f"pods-{self.settings.job_id}", daemon=True
            )
        try:
            # Errors that no retry cures (RBAC, a missing namespace) surface here, in the
            # caller's thread; a transient one is left to the watch thread, which lists again.
            self._relist()
        except KubernetesApiError as exc:
            if not is_transient(exc):
                with self._lock:
                    self._watcher = None
                raise
            self._reports.problem("watch", f"listing the worker pods failed, retrying: {exc}")
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
        delays = settings.retry_backoff.delays()
        while not self._stop.is_set():
            try:
                if self._resource_version is None:
                    self._relist()
                self._watch_once()
                self.watch_error = None
                self._reports.over("watch", "watching the worker pods works again")
                delays = settings.retry_backoff.delays()
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
            self._reports.problem("watch", f"the pod watch failed, retrying: {error}")
            self._stop.wait(min(10.0, next(delays)))

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

    def _stop_watching(self) -> None:
        self._stop.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.close()
        if self._watcher is not None and self._watcher.is_alive():
            self._watcher.join(timeout=10)

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

    def _adopts(self, pod: Pod) -> bool:
        """Whether ``pod`` (one this provisioner did not create) is its own: it carries this
        launcher's owner reference (an earlier launcher pod of the same Job created it)."""
        owner = self.settings.owner_uid
        references = (pod.get("metadata") or {}).get("ownerReferences") or []
        return owner is not None and any(ref.get("uid") == owner for ref in references)

    def _observe_locked(self, name: str, pod: Pod, *, deleted: bool) -> None:
        state = self._pods.get(name)
        status = pod.get("status") or {}
        terminating = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
        if state is None:
            # A pod of this job that this provisioner did not create: an earlier launcher's.
            state = self._pods[name] = _PodState(name, owned=self._adopts(pod))
            if state.owned:
                dead = deleted or terminating or status.get("phase") in ("Failed", "Succeeded")
                # Already dead: the launcher before handled it; only cleaned up at the end.
                state.report_losses = not dead
                log.info(
                    "[%s] adopted pod %s (%s), started by an earlier launcher of this job",
                    self.settings.job_id,
                    name,
                    "dead" if dead else status.get("phase") or "Pending",
                )
        if state.gone:
            return
        if state.token and not state.confirmed:
            annotations = (pod.get("metadata") or {}).get("annotations") or {}
            if annotations.get(CREATION_ANNOTATION) != state.token:
                return  # another pod that took the name: the pending create will see it
            # The pod of a create whose answer was lost (or not yet returned).
            state.deferred = False
            if self._retries.pop(name, None) is not None:
                self._create_works()
        state.confirmed = True
        state.last = pod
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
        if deleted:
            state.gone = True
            state.unschedulable = False
        lost = deleted or terminating or state.phase == "Failed"
        if (
            lost
            and state.owned
            and state.report_losses
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
