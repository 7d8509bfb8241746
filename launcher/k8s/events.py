"""Kubernetes Events for membership changes, recorded on the launcher's pod.

:class:`EventRecorder` is the launcher's event sink in Kubernetes mode: every
:class:`~launcher.leader.policy.MembershipChange` (a join, a leave, a crash, a re-formed ring)
becomes a core/v1 Event whose involvedObject is the launcher's pod (reason Joined, Left, Crashed,
Reformed, StateLost, CheckpointSkipped or Straggler; type Warning for crashes, lost state,
checkpoints that could not be written and stragglers), so ``kubectl describe pod
<launcher>`` and ``kubectl get events`` show the job's history. After each re-formed ring it
also sets the annotation ``elastic-allreduce/ring`` on the launcher's pod (epoch and ranks).

Events are sent from a thread of their own, through the one API client
(:class:`launcher.k8s.client.Kube`), so a slow API never holds up the control loop. A transient
failure (no answer, a timeout, 429, 5xx) is retried with backoff and jitter for up to
``api_deadline`` seconds (:mod:`launcher.k8s.retry`); a request that still fails, or that the API
refuses (403), is logged once per kind of failure and never fails the job.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from launcher.k8s.client import KINDS, Kube
from launcher.k8s.errors import (
    KubernetesApiError,
    KubernetesConflictError,
    KubernetesUnavailableError,
)
from launcher.k8s.naming import EVENT_COMPONENT, RING_ANNOTATION, job_labels
from launcher.k8s.retry import TRANSIENT_BACKOFF, Backoff, retrying
from launcher.vocabulary import ChangeKind, MembershipChange

#: Changes recorded as Warning events (the others are Normal).
_WARNINGS = frozenset(
    {
        ChangeKind.CRASHED,
        ChangeKind.STATE_LOST,
        ChangeKind.CHECKPOINT_SKIPPED,
        ChangeKind.STRAGGLER,
    }
)

log = logging.getLogger(__name__)


class EventRecorder:
    """Records membership changes as Events on the launcher's pod (see the module docstring)."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        pod_name: str,
        pod_uid: str | None,
        job_id: str,
        *,
        api_deadline: float = 60.0,
        backoff: Backoff = TRANSIENT_BACKOFF,
    ) -> None:
        self._kube = kube
        #: Seconds one request is retried through transient failures.
        self.api_deadline = api_deadline
        self._backoff = backoff
        #: Set by close(): requests still failing are not retried any longer.
        self._closing = threading.Event()
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
        """Send what is queued (up to ``timeout`` seconds; a failing request is not retried
        beyond it), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout / 2)
        self._closing.set()
        self._thread.join(timeout=timeout / 2)

    def _send(self, call: Callable[[], object], what: str) -> None:
        retrying(
            call,
            what=what,
            deadline=self.api_deadline,
            stop=self._closing,
            backoff=self._backoff,
        )

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
                "labels": job_labels(self.job_id),
            },
            "involvedObject": involved,
            "reason": change.kind.value,
            "message": f"job {self.job_id}: {change.message}",
            "type": "Warning" if change.kind in _WARNINGS else "Normal",
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": self.pod_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    def _record(self, change: MembershipChange) -> None:
        try:
            event = self.event(change)
            self._send(
                lambda: self._kube.create(event),
                f"create the {change.kind.value} event in namespace {self.namespace!r}",
            )
            self.recorded += 1
        except KubernetesConflictError:
            self.recorded += 1  # an attempt whose answer was lost had created it
        except KubernetesUnavailableError as exc:
            self._warn("connection", f"cannot reach the Kubernetes API to record events: {exc}")
        except KubernetesApiError as exc:
            self._warn(
                f"event-{exc.status}",
                f"cannot record the {change.kind.value} event on pod {self.pod_name} (HTTP "
                f"{exc.status}); the job goes on without Events. A 403 means the launcher's Role "
                f"lacks create on events: apply k8s/. The API said: {exc}",
            )
        if change.kind is ChangeKind.REFORMED:
            self._annotate(change)

    def _annotate(self, change: MembershipChange) -> None:
        """The current ring as an annotation of the launcher's pod (its status at a glance)."""
        ring = f"epoch {change.epoch}: {len(change.slots)} ranks [{','.join(change.slots)}]"
        patch = {"metadata": {"annotations": {RING_ANNOTATION: ring}}}
        try:
            self._send(
                lambda: self._kube.patch(KINDS["Pod"], self.pod_name, self.namespace, patch),
                f"annotate pod {self.pod_name!r} in namespace {self.namespace!r}",
            )
        except KubernetesUnavailableError as exc:
            self._warn("connection", f"cannot reach the Kubernetes API to record events: {exc}")
        except KubernetesApiError as exc:
            self._warn(
                f"patch-{exc.status}",
                f"cannot set the {RING_ANNOTATION} annotation on pod {self.pod_name} (HTTP "
                f"{exc.status}); a 403 means the launcher's Role lacks patch on pods (only this "
                f"annotation needs it). The API said: {exc}",
            )

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("[%s launcher] %s", self.job_id, message)
