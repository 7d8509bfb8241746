"""A kubelet that runs pods as processes: the nodes of the test cluster (issue 19).

``python -m tests.helpers.kube.kubelet --state DIR/state.json --nodes N [--gpus-per-node G]``
(started by :mod:`tests.helpers.kube.cluster` once its API server is ready) talks to the real
API server with the official client (through :class:`launcher.k8s.client.Kube`, with
state.json's ``kubelet_kubeconfig``, else its admin ``kubeconfig``) and does what a kubelet
does, for N nodes at once:

**Nodes.** It registers ``node-1`` .. ``node-N`` with capacity and allocatable ``cpu``,
``memory``, ``pods``, ``ephemeral-storage`` and, with ``--gpus-per-node``, ``nvidia.com/gpu``;
conditions Ready=True and the pressure conditions False; an InternalIP from the cluster's
subnet (``10.233.0.<100+i>``: reported, not configured: no interface has it) and a Hostname.
It renews each node's Lease in ``kube-node-lease`` every 10 s (the node lifecycle controller
marks a node NotReady after 40 s without) and posts the Ready heartbeat every 30 s. A new Node
carries the ``node.kubernetes.io/not-ready`` taint that the TaintNodesByCondition admission
plugin gives it until the node lifecycle controller lifts it (within its 5 s monitor period), as
on a real cluster. On SIGTERM or SIGINT it stops every pod (SIGTERM, SIGKILL after at most 5 s),
removes what it made and deletes its Nodes and their Leases.

**Pods.** It lists and watches all pods (resuming from the last resourceVersion, re-listing
after ``410 Gone``) and runs each pod bound to one of its nodes:

- a network namespace ``<prefix>-p<k>`` (found by the cluster's cleanup) with ``lo`` up and a
  veth ``eth0`` into the cluster's bridge (in ``state["bridge_namespace"]``) holding the pod's own
  IPv4 address, taken in turn from 10.233.1.1 on (never one in use); it reaches every other pod
  and the API server (10.233.0.1:6443), nothing else;
- ``/etc/netns/<ns>/hosts`` and ``resolv.conf`` (``ip netns exec`` bind-mounts them over
  ``/etc``): the pod's host name and, in place of DNS and kube-proxy, the cluster's Service
  names (``svc``, ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.cluster.local``; for endpoints with a
  host name, such as a StatefulSet's pods behind their headless Service,
  ``pod.svc.ns.svc.cluster.local`` and its shorter forms), each at the address of one ready
  endpoint from the EndpointSlices the real controller keeps; rewritten in place when they
  change. Limits: a Service's port must equal its targetPort (connections go straight to the
  pod), one endpoint per name (no load balancing), ClusterIPs are not routable, names not in the
  file fail at once (the name server is the pod's own loopback, where nothing listens);
- the first container's ``command`` and ``args`` (:func:`pod_spec.container_argv`: Kubernetes'
  rules and ``$(VAR)`` expansion) as a process tree in the pod's namespaces, in a session and
  process group of its own, started by :mod:`tests.helpers.kube.pod_init` through ``ip netns
  exec``. **Images are not pulled**: the image's file system is taken to be this machine's, its
  ``PATH`` starts with this checkout's ``.venv/bin`` (so ``elastic-run`` and ``python`` are this
  checkout's) and the working directory is the container's ``workingDir``, else the checkout's
  root. A container without ``command`` runs its image's entrypoint only for this project's
  image (``elastic-allreduce``: ``elastic-run``);
- its environment (:func:`pod_spec.container_env`): ``env`` and ``valueFrom`` (``fieldRef``,
  ``resourceFieldRef``, ``secretKeyRef``, ``configMapKeyRef``, with ``optional``), ``envFrom``,
  ``HOSTNAME`` and ``KUBERNETES_SERVICE_HOST``/``_PORT`` (the API server's own address and port);
- its volumes, mounted inside the pod's own mount namespace only: ``emptyDir`` (a folder under
  ``DIR/pods/<uid>/``; ``medium: Memory`` is a tmpfs of ``sizeLimit``), ``configMap``,
  ``secret``, ``downwardAPI`` and ``projected`` (files with ``items``, ``defaultMode``, ``mode``,
  ``optional``; always read-only), the service-account token (``projected`` from the
  TokenRequest API, bound to the pod, as the ServiceAccount admission plugin asks, or added
  here when the pod has none and automounting is not turned off), ``hostPath`` and
  ``persistentVolumeClaim`` (the bound PersistentVolume's ``hostPath``/``local`` path), with
  ``subPath``/``subPathExpr`` and ``readOnly``. A mount path that does not exist on the machine
  (``/etc/elastic-allreduce-etcd``) is made only inside the pod (see pod_init: a tmpfs over its
  nearest existing folder, holding bind mounts of the originals);
- its status, as a real kubelet reports it (a strategic merge patch of the status subresource,
  guarded by the pod's uid): Pending (ContainerCreating) -> Running with ``podIP``/``podIPs``,
  ``hostIP``/``hostIPs``, ``startTime``, the conditions PodReadyToStartContainers, Initialized,
  ContainersReady and Ready (ready as soon as the process started: **readiness, liveness and
  startup probes are ignored**) and ``containerStatuses`` (``containerID``
  ``process://<pid>``, ``imageID``, ``started``, ``ready``, ``restartCount``, ``state`` and
  ``lastState``: running ``startedAt``; terminated ``exitCode``, ``reason`` Completed / Error /
  StartError, ``signal`` when killed by one, ``startedAt``, ``finishedAt``); then Succeeded or
  Failed under ``restartPolicy: Never`` (or OnFailure after a success); OnFailure and Always
  restart the container in the same sandbox with ``restartCount`` + 1 after a back-off of 1 s
  doubling to 10 s (a real kubelet: 10 s to 5 min), reported as waiting CrashLoopBackOff;
- deletion (``kubectl delete``, an eviction, the scheduler's preemption, garbage collection,
  the node lifecycle controller): on ``deletionTimestamp`` SIGTERM to the container's process
  group, SIGKILL after ``deletionGracePeriodSeconds`` (at least 2 s, as a real kubelet), the
  terminated state and the terminal phase reported, then the deletion finished with a DELETE of
  grace 0 guarded by the pod's uid, as a real kubelet does; then the pod's namespace (every
  process still in it is SIGKILLed), ``/etc/netns/<ns>`` and ``DIR/pods/<uid>`` go. A pod that
  ended on its own keeps its status until deleted (its sandbox is removed at once);
- its output: stdout and stderr of the container, as written, appended to
  ``DIR/pods/<namespace>_<name>/<container>.log`` (emptied when a new pod of that name starts);
  :class:`KubeletClient` reads it for tests. ``kubectl logs`` and ``exec`` do not work: they
  need the kubelet's HTTPS server on port 10250 of the node's address, which the API server
  would reach from its own namespace; this kubelet serves no port.

A spec it cannot run never stops it: an unsupported volume type or field path, a container
without a command for an unknown image, a command that does not exist make that pod Failed
with the reason and message in its status (a missing Secret, ConfigMap, key or unbound claim
keeps the pod Pending with the reason, retried as on a real node). API requests that fail
transiently are retried with back-off (:mod:`launcher.k8s.retry`).

**Not done, by design**: ``resources`` are not enforced (no cgroups: a pod may use the whole
machine; ``nvidia.com/gpu`` is only counted by the scheduler) and ``securityContext`` is ignored
(``runAsUser``, ``runAsNonRoot``, capabilities, ``readOnlyRootFilesystem``: every process runs
as root, with the machine's file system); only the first container runs (init containers make
the pod fail, other containers are reported waiting); ``activeDeadlineSeconds``,
``terminationMessagePath`` (``FallbackToLogsOnError`` works), ``hostNetwork``/``hostPID``,
image pulls and Service environment variables other than ``KUBERNETES_*`` are not supported;
ConfigMap and Secret volumes are written once, when the pod starts.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import ipaddress
import itertools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import kubernetes
import urllib3

from elastic_allreduce.store.cache import new_inbox
from launcher.k8s.client import Kind, Kube, Watch, connect
from launcher.k8s.errors import (
    KubernetesApiError,
    KubernetesConflictError,
    KubernetesNotFoundError,
    KubernetesUnavailableError,
)
from launcher.k8s.retry import Backoff, retrying
from tests.helpers import testhosts
from tests.helpers.kube import pod_spec
from tests.helpers.kube.cluster import mounts_under
from tests.helpers.kube.pod_spec import Obj, PodContext, PodSpecError

log = logging.getLogger(__name__)

ROOT: Final = Path(__file__).resolve().parents[3]
#: The "image": this checkout's virtual environment is first on every container's PATH.
VENV_BIN: Final = ROOT / ".venv" / "bin"
POD_INIT: Final = Path(__file__).with_name("pod_init.py")
#: Environment variables the kubelet passes on to every container when it has them itself:
#: the test session's marker, by which the session-end check finds leftover processes.
INHERITED_ENV: Final = ("ELASTIC_ALLREDUCE_TEST_SESSION",)

GPU_RESOURCE: Final = "nvidia.com/gpu"
POD_INTERFACE: Final = "eth0"
#: Exit status of a container that could not be started (a runtime's StartError).
START_FAILED_EXIT: Final = 128
#: A real kubelet never kills a container in less than this (kuberuntime's minimum grace).
MINIMUM_GRACE: Final = 2.0
TERMINATION_MESSAGE_BYTES: Final = 2048

NODE: Final = Kind("v1", "Node", "nodes", namespaced=False)
LEASE: Final = Kind("coordination.k8s.io/v1", "Lease", "leases")
POD: Final = Kind("v1", "Pod", "pods")
SECRET: Final = Kind("v1", "Secret", "secrets")
CONFIG_MAP: Final = Kind("v1", "ConfigMap", "configmaps")
SERVICE_ACCOUNT: Final = Kind("v1", "ServiceAccount", "serviceaccounts")
CLAIM: Final = Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
VOLUME: Final = Kind("v1", "PersistentVolume", "persistentvolumes", namespaced=False)
#: Collections across all namespaces (Kind's path has no namespace when not namespaced).
ALL_PODS: Final = Kind("v1", "Pod", "pods", namespaced=False)
ALL_SERVICES: Final = Kind("v1", "Service", "services", namespaced=False)
ALL_SLICES: Final = Kind("discovery.k8s.io/v1", "EndpointSlice", "endpointslices", False)

_STRATEGIC: Final = "application/strategic-merge-patch+json"
_MERGE: Final = "application/merge-patch+json"


class KubeletError(RuntimeError):
    """The kubelet could not start, or could not set up or remove a pod's sandbox."""


def now() -> str:
    """The time as the API writes it (RFC 3339, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """The time as a Lease's MicroTime (RFC 3339 with microseconds)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterState:
    """What the kubelet reads of the cluster's state.json (written by cluster.py)."""

    dir: Path
    prefix: str
    bridge_namespace: str
    bridge: str
    subnet: ipaddress.IPv4Network
    apiserver_address: str
    apiserver_port: int
    kubeconfig: Path
    ca_cert: Path

    @classmethod
    def load(cls, path: Path | str) -> ClusterState:
        """Read state.json; KubeletError naming the file and the missing key when unusable."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls(
                dir=Path(raw["dir"]),
                prefix=str(raw["prefix"]),
                bridge_namespace=str(raw["bridge_namespace"]),
                bridge=str(raw["bridge"]),
                subnet=ipaddress.IPv4Network(raw["subnet"]),
                apiserver_address=str(raw["apiserver_address"]),
                apiserver_port=int(raw["apiserver_port"]),
                # The kubelet's own identity when the cluster made one (an administrator, since
                # one process plays every node), else the admin's.
                kubeconfig=Path(raw.get("kubelet_kubeconfig") or raw["kubeconfig"]),
                ca_cert=Path(raw["ca_cert"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KubeletError(f"cannot use the cluster state {path}: {exc!r}") from exc

    @property
    def pods_dir(self) -> Path:
        return self.dir / "pods"


@dataclass(frozen=True)
class KubeletSettings:
    """How many nodes, of what size, and the kubelet's timings."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpu: str = "4"
    memory: str = "16Gi"
    pods: int = 110
    ephemeral_storage: str = "100Gi"
    #: Lease duration, and how often the Lease is renewed and the Ready heartbeat posted.
    lease_seconds: int = 40
    lease_renew: float = 10.0
    status_report: float = 30.0
    #: Back-off between container restarts (Always / OnFailure).
    restart_backoff: Backoff = field(default_factory=lambda: Backoff(first=1.0, cap=10.0))
    #: Back-off while a pod waits for a Secret, ConfigMap, claim or token.
    prepare_backoff: Backoff = field(default_factory=lambda: Backoff(first=0.5, cap=5.0))
    #: Longest grace a pod gets when the kubelet itself stops.
    shutdown_grace: float = 5.0
    #: Seconds one API call is retried through transient failures.
    api_deadline: float = 60.0
    #: Seconds pod_init may take to mount and exec.
    start_timeout: float = 60.0
    #: Server-side timeout of one watch request (then it is renewed).
    watch_timeout: int = 300

    def capacity(self) -> dict[str, str]:
        resources = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "ephemeral-storage": self.ephemeral_storage,
        }
        if self.gpus_per_node > 0:
            resources[GPU_RESOURCE] = str(self.gpus_per_node)
        return resources


@dataclass(frozen=True)
class NodeInfo:
    name: str
    address: str


# -- informers ---------------------------------------------------------------------------------


Handler = Callable[[str, Obj], None]


class Informer:
    """Lists one collection, then watches it from the list's resourceVersion; keeps the
    objects by uid and calls ``handler(type, object)`` (ADDED, MODIFIED, DELETED) from its own
    thread. A watch that ends is renewed from the last resourceVersion; after ``410 Gone`` it
    re-lists (objects gone meanwhile are reported DELETED). Failures are retried with back-off."""

    def __init__(
        self,
        kube: Kube,
        kind: Kind,
        handler: Handler,
        stop: threading.Event,
        watch_timeout: int,
    ) -> None:
        self.kube = kube
        self.kind = kind
        self.handler = handler
        self._stop = stop
        self._watch_timeout = watch_timeout
        self._lock = threading.Lock()
        self._objects: dict[str, Obj] = {}
        self._version: str | None = None
        self._watch: Watch | None = None
        self.synced = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"informer-{kind.plural}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """End the watch and the thread (the stop event is the kubelet's)."""
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.close()
        self._thread.join(timeout=10)

    def objects(self) -> list[Obj]:
        with self._lock:
            return list(self._objects.values())

    def _emit(self, kind: str, obj: Obj) -> None:
        try:
            self.handler(kind, obj)
        except Exception:  # one bad object must not stop the watch
            log.exception("handling %s %s %s failed", kind, self.kind.kind, _name_of(obj))

    def _relist(self) -> None:
        items, version = self.kube.list_with_version(self.kind, None, "")
        present = {str(item["metadata"]["uid"]): item for item in items}
        with self._lock:
            gone = [obj for uid, obj in self._objects.items() if uid not in present]
            changed = [
                (("MODIFIED" if uid in self._objects else "ADDED"), obj)
                for uid, obj in present.items()
                if self._objects.get(uid, {}).get("metadata", {}).get("resourceVersion")
                != obj["metadata"].get("resourceVersion")
            ]
            self._objects = present
            self._version = version
        for obj in gone:
            self._emit("DELETED", obj)
        for kind, obj in changed:
            self._emit(kind, obj)
        self.synced.set()

    def _watch_once(self) -> None:
        watch = self.kube.watch(self.kind, None, "", self._version or "", self._watch_timeout)
        with self._lock:
            self._watch = watch
        try:
            with watch:
                if self._stop.is_set():
                    return
                for event in watch:
                    self._on_event(event)
        finally:
            with self._lock:
                self._watch = None

    def _on_event(self, event: Obj) -> None:
        kind, obj = str(event.get("type")), event["object"]
        if kind == "ERROR":
            if obj.get("code") == 410:
                self._version = None  # too old: list again
                raise _Expired(str(obj.get("message")))
            raise KubernetesApiError(
                f"the watch of {self.kind.plural} failed: {obj.get('code')} "
                f"{obj.get('reason')}: {obj.get('message')}"
            )
        meta = obj.get("metadata") or {}
        if kind == "BOOKMARK":
            self._version = meta.get("resourceVersion") or self._version
            return
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(str(meta.get("uid")), None)
            else:
                self._objects[str(meta.get("uid"))] = obj
            self._version = meta.get("resourceVersion") or self._version
        self._emit(kind, obj)

    def _run(self) -> None:
        delays = Backoff(first=0.2, cap=5.0).delays()
        while not self._stop.is_set():
            try:
                if self._version is None:
                    self._relist()
                self._watch_once()
                delays = Backoff(first=0.2, cap=5.0).delays()
                continue
            except _Expired as exc:
                log.info("the watch of %s expired (%s): listing again", self.kind.plural, exc)
                continue
            except KubernetesApiError as exc:
                if exc.status == 410:
                    self._version = None
                    continue
                if self._stop.is_set():
                    return
                log.warning("watching %s failed, retrying: %s", self.kind.plural, exc)
            self._stop.wait(next(delays))


class _Expired(Exception):
    """A watch's resourceVersion is too old (410 Gone): list again."""


def _name_of(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))


# -- addresses and sandboxes -------------------------------------------------------------------


class AddressPool:
    """Pod addresses from the subnet's second /24 on, in turn (an address freed is reused only
    after all the others), skipping .0 and .255 for legibility."""

    def __init__(self, subnet: ipaddress.IPv4Network) -> None:
        first = int(subnet.network_address) + 256
        last = int(subnet.broadcast_address) - 1
        self._candidates = itertools.cycle(range(first, last + 1))
        self._size = last - first + 1
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            for _ in range(self._size):
                value = next(self._candidates)
                if value not in self._used and value & 0xFF not in {0, 255}:
                    self._used.add(value)
                    return str(ipaddress.IPv4Address(value))
        raise KubeletError("no pod address is free in the cluster's subnet")

    def release(self, address: str) -> None:
        with self._lock:
            self._used.discard(int(ipaddress.IPv4Address(address)))


@dataclass
class Sandbox:
    """A pod's network namespace, its veth, its address and its /etc/netns files."""

    netns: str
    port: str  #: the bridge-side veth end
    ip: str
    etc: Path  #: /etc/netns/<netns>
    hosts: str = ""  #: what /etc/hosts holds now


def _write_in_place(path: Path, text: str) -> None:
    """Rewrite a file without replacing it: the pod's bind mount keeps the same inode."""
    data = text.encode()
    with open(path, "r+b") as out:
        out.write(data)
        out.truncate(len(data))


# -- one pod -----------------------------------------------------------------------------------


@dataclass
class Launch:
    """What pod_init needs to start the container."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    hostname: str
    mounts: list[dict[str, Any]]
    tmpfs: list[dict[str, Any]]


@dataclass
class Run:
    """One run of the container: the process and how it ended."""

    popen: subprocess.Popen[bytes]
    started_at: str
    exited: threading.Event = field(default_factory=threading.Event)
    finished_at: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid


class PodWorker:
    """Runs one pod from its first sight to its deletion, in its own thread; the kubelet's
    watch hands it every new version of the pod (:meth:`update`)."""

    def __init__(self, kubelet: Kubelet, pod: Obj) -> None:
        self.kubelet = kubelet
        meta = pod["metadata"]
        self.uid = str(meta["uid"])
        self.namespace = str(meta.get("namespace", "default"))
        self.name = str(meta["name"])
        self.node = kubelet.nodes[pod["spec"]["nodeName"]]
        self._pod = pod
        self._gone = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.sandbox: Sandbox | None = None
        self.run: Run | None = None
        # What the status says.
        self.phase = "Pending"
        self.reason: str | None = None
        self.message: str | None = None
        self.start_time: str | None = None
        self.restart_count = 0
        self.state: Obj = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: Obj = {}
        self.container_id: str | None = None
        self._conditions: dict[str, Obj] = {}
        self.thread = threading.Thread(
            target=self._main, name=f"pod-{self.namespace}/{self.name}", daemon=True
        )

    def __repr__(self) -> str:
        return f"pod {self.namespace}/{self.name} ({self.uid})"

    # -- what the watch says -----------------------------------------------------------------

    def update(self, pod: Obj, *, gone: bool = False) -> None:
        with self._lock:
            self._pod = pod
            self._gone = self._gone or gone
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    @property
    def pod(self) -> Obj:
        with self._lock:
            return self._pod

    @property
    def gone(self) -> bool:
        with self._lock:
            return self._gone

    @property
    def deleting(self) -> bool:
        with self._lock:
            return self._gone or bool(self._pod["metadata"].get("deletionTimestamp"))

    @property
    def stopping(self) -> bool:
        return self.kubelet.stop.is_set()

    def _interrupted(self) -> bool:
        return self.deleting or self.stopping

    def _wait(self, timeout: float | None = None) -> None:
        """Wait for news (a new version of the pod, the process's exit, the kubelet's stop),
        at most ``timeout`` seconds."""
        self._wake.wait(timeout)
        self._wake.clear()

    # -- the life of the pod -----------------------------------------------------------------

    def _main(self) -> None:
        try:
            try:
                self._lifecycle()
            except Exception as exc:  # a bug or a broken machine: this pod fails, not the rest
                log.exception("%r: the process kubelet failed", self)
                self._kill(0.0)
                self._teardown()
                if not self.stopping and not self.gone:
                    self._finish("Failed", "KubeletError", f"the process kubelet failed: {exc!r}")
                    self._report()
                    self._await_deletion()
        except Exception:
            log.exception("%r: reporting the failure failed", self)
        finally:
            self._kill(0.0)
            self._teardown()
            self.kubelet.worker_done(self)

    def _lifecycle(self) -> None:
        pod = self.pod
        if (pod.get("status") or {}).get("phase") in {"Succeeded", "Failed"}:
            self._await_deletion()  # it ended before this kubelet started
            return
        if self._interrupted():
            self._finish_deletion()
            return
        self.sandbox = self.kubelet.make_sandbox(self)
        self.start_time = now()
        self._set_condition("PodReadyToStartContainers", True)
        self._set_condition("Initialized", True)
        self._set_condition("ContainersReady", False, "ContainersNotReady")
        self._set_condition("Ready", False, "ContainersNotReady")
        self._report()
        launch = self._prepare()
        if launch is None:  # deleted, stopped, or failed for good
            if self.phase == "Failed":
                self._await_deletion()
                return
            if self.deleting and not self.stopping and not self.gone:
                # As a real kubelet: a pod deleted before its container started ends Failed,
                # so that controllers waiting for a terminal phase (the Job controller's
                # job-tracking finalizer) let it go.
                self._finish(
                    "Failed",
                    "ContainerStatusUnknown",
                    "the pod was deleted before its container started",
                )
                self._report()
            self._finish_deletion()
            return
        self._run_container(launch)

    def _run_container(self, launch: Launch) -> None:
        delays = self.kubelet.settings.restart_backoff.delays()
        while True:
            run = self._start(launch)
            if run is not None:
                self._wait_for_exit_or_deletion(run)
                if self._interrupted() and not run.exited.is_set():
                    self._kill(self._grace())
                self._record_exit(run)
            if self._interrupted():
                self._finish_terminal()
                self._finish_deletion()
                return
            if not self._restarts():
                self._finish_terminal()
                self._report()
                self._teardown()
                self._await_deletion()
                return
            delay = next(delays)
            self.restart_count += 1
            self.last_state = self.state
            self.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:.1f}s restarting failed container "
                    f"{launch_name(self.pod)} of {self!r}",
                }
            }
            self._report()
            deadline = time.monotonic() + delay
            while not self._interrupted() and time.monotonic() < deadline:
                self._wait(deadline - time.monotonic())
            if self._interrupted():
                self._finish_terminal()
                self._finish_deletion()
                return

    def _restarts(self) -> bool:
        policy = (self.pod.get("spec") or {}).get("restartPolicy", "Always")
        code = (self.state.get("terminated") or {}).get("exitCode", 1)
        return bool(policy == "Always" or (policy == "OnFailure" and code != 0))

    def _await_deletion(self) -> None:
        """The pod has ended: keep its status until it is deleted, then finish the deletion."""
        while not self._interrupted():
            self._wait()
        self._finish_deletion()

    def _finish_deletion(self) -> None:
        """The last step of a graceful deletion, as a real kubelet does it: DELETE with grace
        0, only for this pod (uid precondition)."""
        if self.stopping or self.gone:
            return
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        # Not found: already gone; conflict: a new pod of the same name.
        with contextlib.suppress(KubernetesNotFoundError, KubernetesConflictError):
            self.kubelet.call(
                lambda: self.kubelet.kube.request(
                    "DELETE", POD, self.namespace, self.name, body=body
                ),
                f"delete {self!r}",
            )
        log.info("%r deleted", self)

    def _grace(self) -> float:
        """Seconds between SIGTERM and SIGKILL: the deletion's grace period (at least 2 s),
        or, when the kubelet stops, at most its shutdown grace."""
        pod = self.pod
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        seconds = max(float(grace), MINIMUM_GRACE)
        if self.stopping:
            seconds = min(seconds, self.kubelet.settings.shutdown_grace)
        return seconds

    # -- preparing the container -------------------------------------------------------------

    def _prepare(self) -> Launch | None:
        """The container's command, environment and mounts; waits (reporting why) while
        something it needs is missing. None when the pod was deleted meanwhile, or failed."""
        delays = self.kubelet.settings.prepare_backoff.delays()
        while not self._interrupted():
            try:
                return self.kubelet.launch_for(self)
            except PodSpecError as exc:
                if not exc.retry:
                    log.warning("the pod fails: %s", exc.message)
                    self._finish("Failed", exc.reason, exc.message)
                    self._report()
                    return None
                if self.state.get("waiting", {}).get("message") != exc.message:
                    log.info("%r waits: %s", self, exc.message)
                    self.state = {"waiting": {"reason": exc.reason, "message": exc.message}}
                    self._report()
                self._wait(next(delays))
        return None

    # -- running it --------------------------------------------------------------------------

    def _start(self, launch: Launch) -> Run | None:
        """Start pod_init (which execs the container); the run, or None when it could not
        start (the terminated state then says why)."""
        started_at = now()
        assert self.sandbox is not None
        popen, failure = self.kubelet.spawn(self, launch)
        self.container_id = f"process://{popen.pid}"
        run = Run(popen, started_at)
        if failure is not None:
            reason, message = failure
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=10)
            log.warning("%r: the container did not start: %s", self, message)
            self.state = {
                "terminated": {
                    "exitCode": START_FAILED_EXIT,
                    "reason": reason,
                    "message": message,
                    "startedAt": started_at,
                    "finishedAt": now(),
                    "containerID": self.container_id,
                }
            }
            self._set_ready(False)
            return None
        threading.Thread(
            target=self._reap, args=(run,), name=f"reap-{popen.pid}", daemon=True
        ).start()
        self.run = run
        self.phase = "Running"
        self.state = {"running": {"startedAt": started_at}}
        self._set_ready(True)
        self._report()
        created = self.pod["metadata"].get("creationTimestamp")
        log.info("%r running (pid %d, %s, created %s)", self, popen.pid, self.sandbox.ip, created)
        return run

    def _reap(self, run: Run) -> None:
        run.popen.wait()
        run.finished_at = now()
        run.exited.set()
        self.wake()

    def _wait_for_exit_or_deletion(self, run: Run) -> None:
        while not run.exited.is_set() and not self._interrupted():
            self._wait()

    def _kill(self, grace: float) -> None:
        """SIGTERM the container's process group, SIGKILL it after ``grace`` seconds."""
        run = self.run
        if run is None or run.exited.is_set():
            return
        _signal_group(run.pid, signal.SIGTERM)
        if not run.exited.wait(grace):
            log.info("%r: still running %.0f s after SIGTERM: SIGKILL", self, grace)
            _signal_group(run.pid, signal.SIGKILL)
            run.exited.wait(10.0)

    def _record_exit(self, run: Run) -> None:
        code = run.popen.returncode
        if code is None:
            return
        terminated: Obj = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": run.started_at,
            "finishedAt": run.finished_at or now(),
            "containerID": self.container_id,
        }
        if code < 0:
            terminated["signal"] = -code
        container = pod_spec.first_container(self.pod)
        if code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            tail = self.kubelet.log_tail(self)
            if tail:
                terminated["message"] = tail
        self.state = {"terminated": terminated}
        self.run = None
        self._set_ready(False)
        log.info("%r: container exited with %s", self, terminated["exitCode"])

    # -- status ------------------------------------------------------------------------------

    def _set_condition(self, kind: str, status: bool, reason: str | None = None) -> None:
        text = "True" if status else "False"
        old = self._conditions.get(kind)
        if old is not None and old["status"] == text and old.get("reason") == reason:
            return
        # A reason no longer true is sent as null: the strategic merge patch removes it.
        self._conditions[kind] = {
            "type": kind,
            "status": text,
            "lastTransitionTime": now(),
            "reason": reason,
            "message": None,
        }

    def _set_ready(self, ready: bool) -> None:
        self._set_condition("ContainersReady", ready, None if ready else "ContainersNotReady")
        self._set_condition("Ready", ready, None if ready else "ContainersNotReady")

    def _finish(self, phase: str, reason: str | None, message: str | None) -> None:
        """The pod failed for good before its container ran: a terminal phase and why."""
        self.phase = phase
        self.reason, self.message = reason, message
        if "terminated" not in self.state:
            self.state = {
                "terminated": {
                    "exitCode": START_FAILED_EXIT,
                    "reason": reason or "Error",
                    "message": message or "",
                    "startedAt": self.start_time or now(),
                    "finishedAt": now(),
                }
            }
        self._set_ready(False)

    def _finish_terminal(self) -> None:
        """The terminal phase after the container ended: Succeeded when it exited with 0."""
        code = (self.state.get("terminated") or {}).get("exitCode")
        self.phase = "Succeeded" if code == 0 else "Failed"
        reason = "PodCompleted" if code == 0 else "PodFailed"
        self._set_condition("ContainersReady", False, reason)
        self._set_condition("Ready", False, reason)
        if self.deleting and not self.stopping and not self.gone:
            self._report()

    def status(self) -> Obj:
        """The pod's status as this kubelet sees it (for a strategic merge patch: the states
        it leaves are set to null)."""
        pod = self.pod
        containers = (pod.get("spec") or {}).get("containers") or []
        first = containers[0] if containers else {"name": "", "image": ""}
        state = {"waiting": None, "running": None, "terminated": None, **self.state}
        main: Obj = {
            "name": first.get("name"),
            "image": first.get("image"),
            "imageID": f"process-kubelet://{first.get('image')}",
            "ready": "running" in self.state,
            "started": "running" in self.state,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": self.last_state,
        }
        if self.container_id:
            main["containerID"] = self.container_id
        statuses = [main] + [
            {
                "name": other.get("name"),
                "image": other.get("image"),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {
                    "waiting": {
                        "reason": "NotRunByProcessKubelet",
                        "message": "the process kubelet runs the first container only",
                    }
                },
            }
            for other in containers[1:]
        ]
        status: Obj = {
            "phase": self.phase,
            "hostIP": self.node.address,
            "hostIPs": [{"ip": self.node.address}],
            "conditions": list(self._conditions.values()),
            "containerStatuses": statuses,
        }
        if self.sandbox is not None:
            status["podIP"] = self.sandbox.ip
            status["podIPs"] = [{"ip": self.sandbox.ip}]
        if self.start_time:
            status["startTime"] = self.start_time
        if self.reason:
            status["reason"] = self.reason
            status["message"] = self.message
        return status

    def _report(self) -> None:
        """Patch the pod's status (retried through transient failures)."""
        if self.stopping or self.gone:
            return
        body = {"metadata": {"uid": self.uid}, "status": self.status()}
        try:
            self.kubelet.call(
                lambda: self.kubelet.kube.request(
                    "PATCH",
                    POD,
                    self.namespace,
                    f"{self.name}/status",
                    body=body,
                    content_type=_STRATEGIC,
                ),
                f"update the status of {self!r}",
            )
        except KubernetesNotFoundError:
            self.update(self.pod, gone=True)
        except KubernetesApiError as exc:
            log.warning("%r: the status update failed: %s", self, exc)

    # -- cleanup -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            self.kubelet.remove_sandbox(self, sandbox)


def launch_name(pod: Obj) -> str:
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return str(containers[0].get("name"))


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


# -- the kubelet -------------------------------------------------------------------------------


class Kubelet:
    """The nodes, the informers and every pod's worker. :meth:`run` until :attr:`stop`."""

    def __init__(self, state: ClusterState, settings: KubeletSettings, kube: Kube) -> None:
        self.state = state
        self.settings = settings
        self.kube = kube
        self.stop = threading.Event()
        self.nodes = {
            f"node-{i}": NodeInfo(f"node-{i}", str(state.subnet.network_address + 100 + i))
            for i in range(1, settings.nodes + 1)
        }
        self.addresses = AddressPool(state.subnet)
        self._sandbox_numbers = itertools.count(1)
        self._lock = threading.Lock()
        self.workers: dict[str, PodWorker] = {}
        self._done: set[str] = set()
        self._ca = state.ca_cert.read_bytes() if state.ca_cert.exists() else b""
        self._registered = now()
        self._server_version = "unknown"
        self._network_changed = threading.Event()
        self.services = Informer(
            kube, ALL_SERVICES, self._on_network, self.stop, settings.watch_timeout
        )
        self.slices = Informer(
            kube, ALL_SLICES, self._on_network, self.stop, settings.watch_timeout
        )
        self.pods = Informer(kube, ALL_PODS, self._on_pod, self.stop, settings.watch_timeout)
        self._threads: list[threading.Thread] = []

    # -- API calls ---------------------------------------------------------------------------

    def call(self, request: Callable[[], Obj], what: str) -> Obj:
        """One API request, retried through transient failures (until the kubelet stops)."""
        return retrying(request, what=what, deadline=self.settings.api_deadline, stop=self.stop)

    # -- run and stop ------------------------------------------------------------------------

    def run(self) -> None:
        """Register the nodes, start watching and heart-beating; return after :attr:`stop`
        is set, with every pod stopped, every sandbox removed and the nodes deleted."""
        self.state.pods_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._server_version = _server_version(self.kube)
            for node in self.nodes.values():
                self._register(node)
            for informer in (self.services, self.slices):
                informer.start()
            for informer in (self.services, self.slices):
                informer.synced.wait(10.0)
            self.pods.start()
            self._spawn_thread(self._heartbeat_loop, "heartbeat")
            self._spawn_thread(self._hosts_loop, "hosts")
            log.info(
                "process kubelet up: nodes %s, capacity %s",
                sorted(self.nodes),
                self.settings.capacity(),
            )
            self.stop.wait()
        finally:
            self.stop.set()
            self.shutdown()

    def _spawn_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def shutdown(self) -> None:
        """Stop every pod (SIGTERM, SIGKILL after the shutdown grace), remove the sandboxes,
        delete the nodes and their Leases."""
        self.stop.set()
        self._network_changed.set()
        for informer in (self.pods, self.services, self.slices):
            informer.close()
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.wake()
        for worker in workers:
            worker.thread.join(timeout=self.settings.shutdown_grace + 30)
        for thread in self._threads:
            thread.join(timeout=10)
        self._remove_leftovers()
        for node in self.nodes.values():
            for kind, namespace in ((LEASE, "kube-node-lease"), (NODE, None)):
                try:
                    self.kube.request("DELETE", kind, namespace, node.name)
                except KubernetesNotFoundError:
                    pass
                except KubernetesApiError as exc:
                    log.warning("could not delete %s %s: %s", kind.kind, node.name, exc)
        log.info("process kubelet stopped: nodes deleted, no pod left")

    def _remove_leftovers(self) -> None:
        """Pod namespaces of this kubelet that a failed teardown left."""
        mine = f"{self.state.prefix}-p"
        for ns in testhosts.all_namespaces():
            if ns.startswith(mine) and ns[len(mine) :].isdigit():
                try:
                    testhosts.kill_namespace(ns)
                except testhosts.TestHostsError:
                    log.exception("could not remove the pod namespace %s", ns)
                shutil.rmtree(testhosts.NETNS_ETC / ns, ignore_errors=True)

    # -- nodes -------------------------------------------------------------------------------

    def _node_conditions(self) -> list[Obj]:
        heartbeat = now()
        rows = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", "sufficient memory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "sufficient PID available"),
            ("Ready", "True", "KubeletReady", "the process kubelet is posting ready status"),
        ]
        return [
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": f"kubelet has {message}" if kind != "Ready" else message,
                "lastHeartbeatTime": heartbeat,
                "lastTransitionTime": self._registered,
            }
            for kind, status, reason, message in rows
        ]

    def _node_status(self, node: NodeInfo) -> Obj:
        capacity = self.settings.capacity()
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": self._node_conditions(),
            "addresses": [
                {"type": "InternalIP", "address": node.address},
                {"type": "Hostname", "address": node.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": node.name,
                "systemUUID": node.name,
                "bootID": f"{os.getpid()}-{node.name}",
                "kernelVersion": os.uname().release,
                "osImage": "process kubelet (tests.helpers.kube.kubelet)",
                "containerRuntimeVersion": "process://1",
                "kubeletVersion": self._server_version,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _register(self, node: NodeInfo) -> None:
        """Create (or take over) the Node, set its status, and create its Lease."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "labels": {
                    "kubernetes.io/hostname": node.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "eakube/process-kubelet": "true",
                },
            },
            "spec": {},
            "status": self._node_status(node),
        }
        try:
            created = self.call(
                lambda: self.kube.request("POST", NODE, None, body=body), f"register {node.name}"
            )
        except KubernetesConflictError:
            created = self.call(
                lambda: self.kube.request("GET", NODE, None, node.name), f"get {node.name}"
            )
        self._post_node_status(node)
        self._renew_lease(node, created["metadata"]["uid"])

    def _post_node_status(self, node: NodeInfo) -> None:
        status = self._node_status(node)
        self.call(
            lambda: self.kube.request(
                "PATCH",
                NODE,
                None,
                f"{node.name}/status",
                body={"status": status},
                content_type=_STRATEGIC,
            ),
            f"post the status of {node.name}",
        )

    def _renew_lease(self, node: NodeInfo, node_uid: str | None = None) -> None:
        patch = {"spec": {"holderIdentity": node.name, "renewTime": micro_now()}}
        try:
            self.kube.request(
                "PATCH", LEASE, "kube-node-lease", node.name, body=patch, content_type=_MERGE
            )
            return
        except KubernetesNotFoundError:
            pass
        meta: Obj = {"name": node.name, "namespace": "kube-node-lease"}
        if node_uid:
            meta["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node_uid}
            ]
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": node.name,
                "leaseDurationSeconds": self.settings.lease_seconds,
                "renewTime": micro_now(),
            },
        }
        with contextlib.suppress(KubernetesConflictError):
            self.kube.request("POST", LEASE, "kube-node-lease", body=lease)

    def _heartbeat_loop(self) -> None:
        next_status = time.monotonic() + self.settings.status_report
        while not self.stop.wait(self.settings.lease_renew):
            post_status = time.monotonic() >= next_status
            if post_status:
                next_status = time.monotonic() + self.settings.status_report
            for node in self.nodes.values():
                try:
                    self._renew_lease(node)
                    if post_status:
                        self._post_node_status(node)
                except KubernetesNotFoundError:
                    log.warning("node %s was deleted: registering it again", node.name)
                    with contextlib.suppress(KubernetesApiError):
                        self._register(node)
                except KubernetesApiError as exc:
                    log.warning("heartbeat of %s failed: %s", node.name, exc)

    # -- pods --------------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: Obj) -> None:
        if (pod.get("spec") or {}).get("nodeName") not in self.nodes:
            return
        uid = str(pod["metadata"]["uid"])
        with self._lock:
            if self.stop.is_set():
                return
            if uid in self._done:
                if kind == "DELETED":
                    self._done.discard(uid)
                return
            worker = self.workers.get(uid)
            if worker is None:
                if kind == "DELETED":
                    return
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.thread.start()
                return
        worker.update(pod, gone=kind == "DELETED")

    def worker_done(self, worker: PodWorker) -> None:
        with self._lock:
            self.workers.pop(worker.uid, None)
            if not worker.gone:
                self._done.add(worker.uid)

    # -- sandboxes ---------------------------------------------------------------------------

    def pod_dir(self, worker: PodWorker) -> Path:
        return self.state.pods_dir / worker.uid

    def log_dir(self, worker: PodWorker) -> Path:
        return self.state.pods_dir / f"{worker.namespace}_{worker.name}"

    def make_sandbox(self, worker: PodWorker) -> Sandbox:
        """The pod's network namespace, veth into the bridge, address and /etc files."""
        number = next(self._sandbox_numbers)
        netns = f"{self.state.prefix}-p{number}"
        sandbox = Sandbox(
            netns=netns,
            port=f"pod{number}",
            ip=self.addresses.take(),
            etc=testhosts.NETNS_ETC / netns,
        )
        ip = testhosts._ip
        bridge_ns = self.state.bridge_namespace
        try:
            ip("netns", "add", netns)
            ip("-n", netns, "link", "set", "lo", "up")
            ip(
                *("-n", netns, "link", "add", POD_INTERFACE, "type", "veth"),
                *("peer", "name", sandbox.port, "netns", bridge_ns),
            )
            ip("-n", bridge_ns, "link", "set", sandbox.port, "master", self.state.bridge, "up")
            prefix = self.state.subnet.prefixlen
            ip("-n", netns, "addr", "add", f"{sandbox.ip}/{prefix}", "dev", POD_INTERFACE)
            ip("-n", netns, "link", "set", POD_INTERFACE, "up")
            sandbox.etc.mkdir(parents=True, exist_ok=True)
            sandbox.hosts = self.hosts_for(worker.pod, sandbox.ip)
            (sandbox.etc / "hosts").write_text(sandbox.hosts)
            (sandbox.etc / "resolv.conf").write_text(pod_spec.resolv_conf(worker.namespace))
            self._record_sandbox(worker, sandbox)

            def carrier() -> bool:
                (link,) = testhosts._ip_json("-n", netns, "link", "show", "dev", POD_INTERFACE)
                return "LOWER_UP" in link["flags"]

            testhosts._wait_until(carrier, 10.0, f"{POD_INTERFACE} in {netns} to come up")
        except BaseException:
            self.remove_sandbox(worker, sandbox)
            raise
        return sandbox

    def _record_sandbox(self, worker: PodWorker, sandbox: Sandbox) -> None:
        """DIR/pods/<ns>_<name>/pod.json: where tests find the pod's namespace and address."""
        folder = self.log_dir(worker)
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "uid": worker.uid,
            "netns": sandbox.netns,
            "ip": sandbox.ip,
            "node": worker.node.name,
        }
        owner = folder / "uid"  # stays after the pod: whose logs these are
        with contextlib.suppress(OSError):
            if owner.read_text().strip() != worker.uid:
                for stale in folder.glob("*.log"):
                    stale.unlink()
        owner.write_text(worker.uid + "\n")
        (folder / "pod.json").write_text(json.dumps(record) + "\n")

    def remove_sandbox(self, worker: PodWorker, sandbox: Sandbox) -> None:
        """Kill what still runs in the pod's namespace, delete it (its veth goes with it),
        its /etc/netns folder and the pod's folder; free its address."""
        try:
            testhosts.kill_namespace(sandbox.netns)
        except testhosts.TestHostsError:
            log.exception("%r: could not remove the namespace %s", worker, sandbox.netns)
        shutil.rmtree(sandbox.etc, ignore_errors=True)
        self.addresses.release(sandbox.ip)
        with contextlib.suppress(OSError, ValueError):
            record = self.log_dir(worker) / "pod.json"
            if json.loads(record.read_text()).get("uid") == worker.uid:
                record.unlink()
        pod_dir = self.pod_dir(worker)
        if mounts_under(pod_dir):
            log.error("%r: mounts left under %s: its folder stays", worker, pod_dir)
        else:
            shutil.rmtree(pod_dir, ignore_errors=True)

    # -- hosts files -------------------------------------------------------------------------

    def _on_network(self, kind: str, obj: Obj) -> None:
        self._network_changed.set()

    def hosts_for(self, pod: Obj, pod_ip: str) -> str:
        names = pod_spec.service_names(
            str(pod["metadata"].get("namespace", "default")),
            self.services.objects(),
            self.slices.objects(),
        )
        return pod_spec.hosts_file(pod, pod_ip, names)

    def _hosts_loop(self) -> None:
        """Rewrite the pods' hosts files (in place) when Services or endpoints change."""
        while True:
            self._network_changed.wait()
            if self.stop.is_set():
                return
            self._network_changed.clear()
            with self._lock:
                workers = list(self.workers.values())
            for worker in workers:
                sandbox = worker.sandbox
                if sandbox is None:
                    continue
                text = self.hosts_for(worker.pod, sandbox.ip)
                if text != sandbox.hosts:
                    with contextlib.suppress(OSError):  # the sandbox went meanwhile
                        _write_in_place(sandbox.etc / "hosts", text)
                        sandbox.hosts = text

    # -- preparing and starting containers ---------------------------------------------------

    def context(self, worker: PodWorker) -> PodContext:
        assert worker.sandbox is not None
        return PodContext(
            pod=worker.pod,
            sources=ApiSources(self),
            pod_ip=worker.sandbox.ip,
            host_ip=worker.node.address,
            allocatable=self.settings.capacity(),
            ca_cert=self._ca,
        )

    def launch_for(self, worker: PodWorker) -> Launch:
        """The container's argv, env, working directory and mounts (volumes written)."""
        pod = worker.pod
        spec = pod.get("spec") or {}
        if spec.get("initContainers"):
            raise PodSpecError(
                "UnsupportedPodSpec",
                f"{worker!r}: initContainers are not supported by the process kubelet",
            )
        if spec.get("hostNetwork"):
            raise PodSpecError(
                "UnsupportedPodSpec",
                f"{worker!r}: hostNetwork is not supported by the process kubelet",
            )
        ctx = self.context(worker)
        container = pod_spec.first_container(pod)
        hostname = pod_spec.pod_hostname(pod)
        base = pod_spec.default_env(str(VENV_BIN), hostname)
        for name in INHERITED_ENV:
            if name in os.environ:
                base[name] = os.environ[name]
        env = pod_spec.container_env(
            ctx,
            container,
            base=base,
            services=pod_spec.service_env(self.state.apiserver_address, self.state.apiserver_port),
        )
        argv = pod_spec.container_argv(ctx, container, env)
        mounts, tmpfs = Volumes(self, worker, ctx).mounts(container, env)
        return Launch(
            argv=argv,
            env=env,
            cwd=str(container.get("workingDir") or ROOT),
            hostname=hostname,
            mounts=mounts,
            tmpfs=tmpfs,
        )

    def spawn(
        self, worker: PodWorker, launch: Launch
    ) -> tuple[subprocess.Popen[bytes], tuple[str, str] | None]:
        """Start pod_init in the pod's namespace; the process and, when the container could
        not be started, (reason, message)."""
        assert worker.sandbox is not None
        pod_dir = self.pod_dir(worker)
        scratch = pod_dir / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        spec_file = pod_dir / "init.json"  # holds the env, Secrets included: root only
        spec_file.touch(mode=0o600)
        spec_file.write_text(
            json.dumps(
                {
                    "argv": launch.argv,
                    "env": launch.env,
                    "cwd": launch.cwd,
                    "hostname": launch.hostname,
                    "scratch": str(scratch),
                    "mounts": launch.mounts,
                    "tmpfs": launch.tmpfs,
                }
            )
        )
        log_dir = self.log_dir(worker)
        log_dir.mkdir(parents=True, exist_ok=True)
        read_end, write_end = os.pipe()
        try:
            with open(log_dir / f"{launch_name(worker.pod)}.log", "ab") as output:
                popen = subprocess.Popen(
                    [
                        *("ip", "netns", "exec", worker.sandbox.netns),
                        *(sys.executable, "-I", str(POD_INIT), str(spec_file)),
                        *("--status-fd", str(write_end)),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(write_end,),
                    env={"PATH": os.environ.get("PATH", pod_spec.SYSTEM_PATH)},
                    cwd=ROOT,
                )
            os.close(write_end)
            write_end = -1
            return popen, self._start_outcome(read_end, popen)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)

    def _start_outcome(
        self, read_end: int, popen: subprocess.Popen[bytes]
    ) -> tuple[str, str] | None:
        """None when pod_init exec'd the container (its status pipe closed empty), else
        (reason, message)."""
        deadline = time.monotonic() + self.settings.start_timeout
        data = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([read_end], [], [], remaining)[0]:
                _signal_group(popen.pid, signal.SIGKILL)
                return (
                    "StartError",
                    f"the container did not start within {self.settings.start_timeout:.0f} s",
                )
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            data += chunk
        if not data:
            return None
        try:
            report = json.loads(data.decode(errors="replace").splitlines()[0])
            return str(report["reason"]), str(report["message"])
        except (ValueError, KeyError, IndexError):
            return "StartError", data.decode(errors="replace").strip()[:500]

    def log_tail(self, worker: PodWorker) -> str:
        path = self.log_dir(worker) / f"{launch_name(worker.pod)}.log"
        try:
            with open(path, "rb") as source:
                source.seek(0, os.SEEK_END)
                size = source.tell()
                source.seek(max(0, size - TERMINATION_MESSAGE_BYTES))
                return source.read().decode(errors="replace").strip()
        except OSError:
            return ""


def _server_version(kube: Kube) -> str:
    """The API server's version, which the nodes report as their kubelet's."""
    try:
        info = kubernetes.client.VersionApi(kube.api).get_code(_request_timeout=15)
    except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubernetesUnavailableError(
            f"cannot read the API server's version at {kube.host}: {exc}"
        ) from exc
    return str(info.git_version)


# -- what pods refer to ------------------------------------------------------------------------


class ApiSources:
    """Secrets, ConfigMaps and tokens from the API server (for :mod:`pod_spec`)."""

    def __init__(self, kubelet: Kubelet) -> None:
        self.kubelet = kubelet

    def _object(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        try:
            return self.kubelet.call(
                lambda: self.kubelet.kube.request("GET", kind, namespace, name),
                f"get {kind.kind} {namespace}/{name}",
            )
        except KubernetesNotFoundError:
            return None
        except KubernetesApiError as exc:
            raise PodSpecError(
                "CreateContainerConfigError",
                f"reading {kind.kind} {namespace}/{name} failed: {exc}",
                retry=True,
            ) from exc

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        found = self._object(SECRET, namespace, name)
        if found is None:
            return None
        return {k: base64.b64decode(v) for k, v in (found.get("data") or {}).items()}

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        found = self._object(CONFIG_MAP, namespace, name)
        if found is None:
            return None
        data = {k: str(v).encode() for k, v in (found.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (found.get("binaryData") or {}).items()})
        return data

    def token(self, pod: Obj, audience: str | None, expiration: int) -> str:
        meta = pod["metadata"]
        namespace = str(meta.get("namespace", "default"))
        account = str((pod.get("spec") or {}).get("serviceAccountName") or "default")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": max(600, expiration),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        try:
            answer = self.kubelet.call(
                lambda: self.kubelet.kube.request(
                    "POST", SERVICE_ACCOUNT, namespace, f"{account}/token", body=body
                ),
                f"request a token of service account {namespace}/{account}",
            )
        except KubernetesApiError as exc:
            raise PodSpecError(
                "FailedMount",
                f"pod {namespace}/{meta['name']}: cannot get a token of service account "
                f"{account!r}: {exc}",
                retry=True,
            ) from exc
        return str((answer.get("status") or {}).get("token", ""))


class Volumes:
    """Makes a pod's volumes on disk and says what pod_init mounts where."""

    def __init__(self, kubelet: Kubelet, worker: PodWorker, ctx: PodContext) -> None:
        self.kubelet = kubelet
        self.worker = worker
        self.ctx = ctx
        self.root = kubelet.pod_dir(worker) / "volumes"

    def _automount(self) -> bool:
        """Whether the service-account token is mounted although the pod has no volume for it
        (the ServiceAccount admission plugin normally adds one)."""
        spec = self.ctx.pod.get("spec") or {}
        if spec.get("automountServiceAccountToken") is not None:
            return bool(spec["automountServiceAccountToken"])
        account = str(spec.get("serviceAccountName") or "default")
        found = ApiSources(self.kubelet)._object(SERVICE_ACCOUNT, self.ctx.namespace, account)
        return found is None or found.get("automountServiceAccountToken") is not False

    def mounts(
        self, container: Obj, env: Mapping[str, str]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(mounts, tmpfs folders) for pod_init; every volume the container mounts is made."""
        volumes = {
            str(v.get("name")): v for v in (self.ctx.pod.get("spec") or {}).get("volumes") or []
        }
        wanted = list(container.get("volumeMounts") or [])
        has_token = any(m.get("mountPath") == pod_spec.SERVICE_ACCOUNT_MOUNT for m in wanted)
        if not has_token and self._automount():
            extra = pod_spec.service_account_volume(self.ctx.pod)
            volumes[extra["name"]] = extra
            wanted.append(
                {
                    "name": extra["name"],
                    "mountPath": pod_spec.SERVICE_ACCOUNT_MOUNT,
                    "readOnly": True,
                }
            )
        made: dict[str, tuple[Path, bool]] = {}
        tmpfs: list[dict[str, Any]] = []
        mounts: list[dict[str, Any]] = []
        for mount in wanted:
            name = str(mount.get("name"))
            volume = volumes.get(name)
            if volume is None:
                raise PodSpecError(
                    "CreateContainerConfigError",
                    f"{self.worker!r}: volumeMount {name!r} names no volume of the pod",
                )
            if name not in made:
                made[name] = self._make(volume, tmpfs)
            source, readonly = made[name]
            sub = mount.get("subPath") or (
                pod_spec.expand(str(mount["subPathExpr"]), env) if mount.get("subPathExpr") else ""
            )
            if sub:
                source = source / pod_spec.safe_relative(
                    repr(self.worker), str(sub), f"volumeMount {name!r}"
                )
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            mounts.append(
                {
                    "source": str(source),
                    "target": str(mount.get("mountPath")),
                    "readonly": bool(mount.get("readOnly")) or readonly,
                }
            )
        return mounts, tmpfs

    def _make(self, volume: Obj, tmpfs: list[dict[str, Any]]) -> tuple[Path, bool]:
        """Make one volume; (its folder or file on the machine, always read-only)."""
        name = str(volume.get("name"))
        folder = self.root / name
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o777)
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                limit = empty.get("sizeLimit")
                size = int(pod_spec.quantity(limit)) if limit else None
                tmpfs.append({"path": str(folder), "size": size})
            return folder, False
        if any(kind in volume for kind in ("secret", "configMap", "downwardAPI", "projected")):
            files = pod_spec.volume_files(self.ctx, volume)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            folder.chmod(0o755)
            for item in files:
                path = folder / item.path
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(item.data)
                path.chmod(item.mode)
            return folder, True
        if "hostPath" in volume:
            return self._host_path(volume["hostPath"], name), False
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            return self._claim(str(claim.get("claimName")), name), bool(claim.get("readOnly"))
        kinds = sorted(k for k in volume if k != "name")
        raise PodSpecError(
            "UnsupportedVolume",
            f"{self.worker!r}: volume {name!r} of type {', '.join(kinds) or '?'} is not "
            "supported by the process kubelet (emptyDir, configMap, secret, downwardAPI, "
            "projected, hostPath and persistentVolumeClaim are)",
        )

    def _host_path(self, source: Obj, name: str) -> Path:
        path = Path(str(source.get("path")))
        kind = source.get("type") or ""
        if kind in {"", "DirectoryOrCreate"} and not path.exists():
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate" and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        checks = {"Directory": path.is_dir, "File": path.is_file, "Socket": path.is_socket}
        check = checks.get(str(kind))
        if check is not None and not check():
            raise PodSpecError(
                "FailedMount",
                f"{self.worker!r}: hostPath volume {name!r}: {path} is not a {kind}",
                retry=True,
            )
        return path

    def _claim(self, claim_name: str, name: str) -> Path:
        namespace = self.ctx.namespace
        sources = ApiSources(self.kubelet)
        claim = sources._object(CLAIM, namespace, claim_name)
        if claim is None:
            raise PodSpecError(
                "FailedMount",
                f"{self.worker!r}: volume {name!r}: persistentvolumeclaim {claim_name!r} not found",
                retry=True,
            )
        bound = (claim.get("spec") or {}).get("volumeName")
        if not bound or (claim.get("status") or {}).get("phase") != "Bound":
            raise PodSpecError(
                "FailedMount",
                f"{self.worker!r}: volume {name!r}: persistentvolumeclaim {claim_name!r} is "
                "not bound",
                retry=True,
            )
        volume = sources._object(VOLUME, "", bound) if bound else None
        spec = (volume or {}).get("spec") or {}
        path = (spec.get("hostPath") or {}).get("path") or (spec.get("local") or {}).get("path")
        if not path:
            raise PodSpecError(
                "UnsupportedVolume",
                f"{self.worker!r}: volume {name!r}: PersistentVolume {bound!r} is neither "
                "hostPath nor local",
            )
        return Path(str(path))


# -- for tests ---------------------------------------------------------------------------------


class KubeletClient:
    """What tests read from a running process kubelet: pods' output, addresses, namespaces."""

    def __init__(self, state: Mapping[str, Any] | Path | str) -> None:
        values: Mapping[str, Any] = (
            state if isinstance(state, Mapping) else json.loads(Path(state).read_text())
        )
        self.dir = Path(str(values["dir"]))
        self.prefix = str(values["prefix"])

    @property
    def pods_dir(self) -> Path:
        return self.dir / "pods"

    def log_path(self, namespace: str, pod: str, container: str | None = None) -> Path:
        """The file of the container's output (the first container's when not named)."""
        folder = self.pods_dir / f"{namespace}_{pod}"
        if container is not None:
            return folder / f"{container}.log"
        logs = sorted(folder.glob("*.log"))
        return logs[0] if logs else folder / "missing.log"

    def log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """What the pod's container printed so far ("" before it printed anything)."""
        try:
            return self.log_path(namespace, pod, container).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, namespace: str, pod: str, text: str, timeout: float = 30.0) -> str:
        """The pod's output once it contains ``text``; TimeoutError (with the output) when it
        does not within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while True:
            output = self.log(namespace, pod)
            if text in output:
                return output
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"pod {namespace}/{pod} did not print {text!r} within {timeout} s; it "
                    f"printed:\n{output[-2000:]}"
                )
            pause.wait(min(0.05, remaining))

    def sandbox(self, namespace: str, pod: str) -> dict[str, Any] | None:
        """``{"uid", "netns", "ip", "node"}`` of the pod while its sandbox exists."""
        try:
            return dict(json.loads((self.pods_dir / f"{namespace}_{pod}" / "pod.json").read_text()))
        except (OSError, ValueError):
            return None

    def pod_namespaces(self) -> list[str]:
        """The network namespaces of pods that exist now."""
        mine = f"{self.prefix}-p"
        return [ns for ns in testhosts.all_namespaces() if ns.startswith(mine)]


# -- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.helpers.kube.kubelet",
        description="Run the pods of a test cluster's nodes as processes (docs/kubernetes.md).",
    )
    parser.add_argument("--state", type=Path, required=True, help="the cluster's state.json")
    parser.add_argument("--nodes", type=int, default=1, help="how many nodes to register")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per node")
    parser.add_argument("--cpu", default="4", help="cpu capacity of each node")
    parser.add_argument("--memory", default="16Gi", help="memory capacity of each node")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(threadName)s %(message)s",
        stream=sys.stderr,
    )
    if not 1 <= args.nodes <= 100 or args.gpus_per_node < 0:
        print("kubelet: --nodes must be 1..100 and --gpus-per-node >= 0", file=sys.stderr)
        return 2
    try:
        state = ClusterState.load(args.state)
        kube = connect(kubeconfig=str(state.kubeconfig), request_timeout=15.0)
    except (KubeletError, KubernetesApiError) as exc:
        print(f"kubelet: {exc}", file=sys.stderr)
        return 2
    settings = KubeletSettings(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpu=args.cpu, memory=args.memory
    )
    kubelet = Kubelet(state, settings, kube)

    # A handler runs in the main thread, maybe while it holds kubelet.stop's lock: it only puts
    # into a SimpleQueue (reentrant), and a thread sets the event.
    signals = new_inbox()

    def forward_signal() -> None:
        signum = signals.get()
        log.info("signal %s: stopping every pod and deleting the nodes", signum)
        kubelet.stop.set()

    def stop(signum: int, frame: object) -> None:
        signals.put(signum)

    threading.Thread(target=forward_signal, name="signals", daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        kubelet.run()
    except KubernetesApiError as exc:
        log.error("the process kubelet failed: %s", exc)
        return 1
    finally:
        kube.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
