"""Kubernetes Events for membership changes, recorded on the launcher's pod.

:class:`EventRecorder` is the launcher's event sink in Kubernetes mode: every
:class:`~launcher.policy.MembershipChange` (a join, a leave, a crash, a re-formed ring) becomes a
core/v1 Event whose involvedObject is the launcher's pod (reason Joined, Left, Crashed or
Reformed; type Warning for crashes), so ``kubectl describe pod <launcher>`` and ``kubectl get
events`` show the job's history. After each re-formed ring it also sets the annotation
``elastic-allreduce/ring`` on the launcher's pod (epoch and ranks).

Events are sent from a thread of their own, so a slow API never holds up the control loop; a
failed request is logged (once per kind of failure) and never fails the job.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
import time
from typing import Any, Final

import kubernetes

from launcher.policy import ChangeKind, MembershipChange
from launcher.provisioners.kubernetes import APP_LABEL, APP_NAME, CONNECTION_ERRORS, JOB_LABEL

log = logging.getLogger(__name__)

RING_ANNOTATION: Final = "elastic-allreduce/ring"
COMPONENT: Final = "elastic-allreduce-launcher"


class EventRecorder:
    """Records membership changes as Events on the launcher's pod (see the module docstring)."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        namespace: str,
        pod_name: str,
        pod_uid: str | None,
        job_id: str,
    ) -> None:
        self._core: Any = kubernetes.client.CoreV1Api(api_client)
        self.namespace = namespace
        self.pod_name = pod_name
        self.pod_uid = pod_uid
        self.job_id = job_id
        self._numbers = itertools.count(1)
        self._queue: queue.Queue[MembershipChange | None] = queue.Queue()
        self._warned: set[str] = set()
        #: Events created so far (for logs and tests).
        self.recorded = 0
        self._thread = threading.Thread(target=self._run, name="k8s-events", daemon=True)
        self._thread.start()

    def __call__(self, change: MembershipChange) -> None:
        """The launcher's event sink: never blocks."""
        self._queue.put(change)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            change = self._queue.get()
            if change is None:
                return
            self._record(change)

    def event(self, change: MembershipChange) -> dict[str, Any]:
        """The core/v1 Event for one change."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        involved: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self.pod_name,
            "namespace": self.namespace,
        }
        if self.pod_uid:
            involved["uid"] = self.pod_uid
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                # Like the kubelet's: <object>.<unique suffix>.
                "name": f"{self.pod_name}.{time.time_ns():x}{next(self._numbers):x}",
                "namespace": self.namespace,
                "labels": {APP_LABEL: APP_NAME, JOB_LABEL: self.job_id},
            },
            "involvedObject": involved,
            "reason": change.kind.value,
            "message": f"job {self.job_id}: {change.message}",
            "type": "Warning" if change.kind is ChangeKind.CRASHED else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.pod_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    def _record(self, change: MembershipChange) -> None:
        try:
            self._core.create_namespaced_event(self.namespace, self.event(change))
            self.recorded += 1
        except kubernetes.client.exceptions.ApiException as exc:
            self._warn(
                f"event-{exc.status}",
                f"cannot record the {change.kind.value} event on pod {self.pod_name} "
                f"({exc.status} {exc.reason}); the job goes on without Events. A 403 means the "
                "launcher's Role lacks create on events: apply k8s/",
            )
        except CONNECTION_ERRORS as exc:
            self._warn("connection", f"cannot reach the Kubernetes API to record events: {exc}")
        if change.kind is ChangeKind.REFORMED:
            self._annotate(change)

    def _annotate(self, change: MembershipChange) -> None:
        """The current ring as an annotation of the launcher's pod (its status at a glance)."""
        ring = f"epoch {change.epoch}: {len(change.slots)} ranks [{','.join(change.slots)}]"
        patch = {"metadata": {"annotations": {RING_ANNOTATION: ring}}}
        try:
            self._core.patch_namespaced_pod(self.pod_name, self.namespace, patch)
        except kubernetes.client.exceptions.ApiException as exc:
            self._warn(
                f"patch-{exc.status}",
                f"cannot set the {RING_ANNOTATION} annotation on pod {self.pod_name} "
                f"({exc.status} {exc.reason}); a 403 means the launcher's Role lacks patch on "
                "pods (only this annotation needs it)",
            )
        except CONNECTION_ERRORS as exc:
            self._warn("connection", f"cannot reach the Kubernetes API to record events: {exc}")

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("[%s launcher] %s", self.job_id, message)
