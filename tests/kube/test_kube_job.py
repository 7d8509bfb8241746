"""A real job on the real control plane: `elastic-run k8s render` applied to the API server, the
launcher Job's pod creating worker pods that the real scheduler places on the process kubelet's
nodes (issue 19, item 4).

Real API server, scheduler (priority preemption), Job controller (the launcher pod replaced)
and garbage collector; real etcd (the session's, reached by the pods through a forwarder); real
Horovod/Gloo between pods that each have their own address. The schedule of the long test:

1. three workers train (2 CPUs each on two 4-CPU nodes: one node also holds the launcher, so
   the cluster is full);
2. a worker pod is deleted: its agent leaves gracefully and a replacement pod joins; a worker's
   container is killed (SIGKILL): the pod fails, a crash epoch, and a replacement joins; the
   launcher's Events on its pod tell both;
3. a pod of a higher priority arrives: the scheduler preempts a worker (its own event says so),
   the job shrinks to two and trains on while the replacement stays Pending; the intruder goes,
   the replacement is placed and joins: three again;
4. the launcher pod is deleted: it hands the job over (exit code 5), the Job controller starts a
   new pod and that launcher adopts the job, whose workers trained on;
5. the test asks training to stop: every rank finishes with the same weights, the Job
   completes and the launcher deleted its worker pods.

Deleting the launcher Job garbage-collects its worker pods (they are owned by the Job).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_allreduce.records.snapshot import JobSnapshot, read_job
from elastic_allreduce.records.values import JobPhase, RingState
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from launcher.k8s.client import Kind, Kube
from tests.conftest import ROOT, fresh_job_id, require_checkout_outside_tmp
from tests.helpers.kube.cluster import KubeCluster
from tests.helpers.kube.kubelet import KubeletClient
from tests.kube.conftest import POD, wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = str(ROOT / "tests" / "scripts" / "train_until.py")
JOB = Kind("batch/v1", "Job", "jobs")
EVENT = Kind("v1", "Event", "events")
PRIORITY_CLASS = Kind("scheduling.k8s.io/v1", "PriorityClass", "priorityclasses", namespaced=False)
#: Every pod of the cluster (a cluster-wide list).
ALL_PODS = Kind("v1", "Pod", "pods", namespaced=False)
#: Above the workers' (-5), below the launcher's (1000): it may preempt workers only.
URGENT = "eatest-urgent"
Obj = dict[str, Any]


@pytest.fixture
def pod_etcd(kube_cluster: KubeCluster, etcd_server: EmbeddedEtcd) -> Iterator[str]:
    """The session's etcd as the pods reach it (``http://10.233.0.1:<port>``)."""
    require_checkout_outside_tmp("the launcher pod's emptyDir")
    endpoint, forwarder = kube_cluster.expose_to_pods(
        f"etcd-forward-{os.getpid()}-{time.monotonic_ns()}", etcd_server.client_port
    )
    try:
        yield f"http://{endpoint}"
    finally:
        forwarder.stop(10.0)
        kube_cluster.processes.pop(forwarder.name, None)


@pytest.fixture
def room(kube: Kube, namespace: str) -> None:
    """Wait until no other test's pod holds a node's CPUs (the namespaces of earlier tests are
    deleted without waiting): the schedule below counts on the nodes' whole capacity."""

    def others() -> list[str]:
        return [
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in kube.list(ALL_PODS, None, "")
            if p["metadata"]["namespace"] != namespace
            and p["spec"].get("nodeName")
            and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
        ]

    wait(lambda: not others(), 180, "other tests' pods to leave the nodes", lambda: str(others()))


@pytest.fixture(scope="module")
def urgent_class(kube: Kube) -> Iterator[str]:
    body = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": URGENT},
        "value": 100,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    if kube.get(PRIORITY_CLASS, URGENT, None) is None:
        kube.request("POST", PRIORITY_CLASS, None, body=body)
    yield URGENT


def render(namespace: str, etcd: str, job_id: str, *flags: str, stop_file: Path) -> str:
    """The job's objects as `elastic-run k8s render` writes them for users."""
    done = subprocess.run(
        [
            sys.executable, "-m", "launcher.cli", "k8s", "render",
            "--image", "elastic-allreduce:dev", "--namespace", namespace, "--etcd", etcd,
            "--no-network-policy", "--with-priority-class", "--cpu", "2", "--memory", "1Gi",
            "--job-id", job_id, *flags,
            "--", "python", SCRIPT, "--stop-file", str(stop_file), "--step-delay", "0.05",
        ],
        capture_output=True, text=True, check=False, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


class JobWatch:
    """The job as the store and the API server show it."""

    def __init__(self, kube: Kube, kubelet: KubeletClient, namespace: str, store: EtcdStore):
        self.kube, self.kubelet, self.namespace, self.store = kube, kubelet, namespace, store

    def snapshot(self) -> JobSnapshot:
        return read_job(self.store)

    def running_ring(self) -> tuple[int, tuple[str, ...]] | None:
        """(epoch, slots) of the running ring, if one runs."""
        ring = self.snapshot().ring
        if ring is None or ring.record.state is not RingState.RUNNING:
            return None
        return ring.record.epoch, ring.record.slots

    def committed_step(self) -> int:
        progress = self.snapshot().progress
        step = None if progress is None else progress.record.get("step")
        return step if isinstance(step, int) else -1

    def pods(self, role: str) -> dict[str, Obj]:
        return {
            p["metadata"]["name"]: p
            for p in self.kube.list(POD, self.namespace, f"elastic-allreduce/role={role}")
        }

    def running(self, role: str) -> dict[str, Obj]:
        return {
            name: pod
            for name, pod in self.pods(role).items()
            if pod.get("status", {}).get("phase") == "Running"
            and not pod["metadata"].get("deletionTimestamp")
        }

    def wait_size(self, size: int, after_epoch: int, timeout: float, what: str) -> int:
        """Wait for a running ring of ``size`` ranks in an epoch after ``after_epoch`` that
        has committed since; its epoch."""

        def formed() -> int | None:
            ring = self.running_ring()
            if ring is None or ring[0] <= after_epoch or len(ring[1]) != size:
                return None
            progress = self.snapshot().progress
            if progress is None or progress.record.size != size:
                return None
            return ring[0]

        epoch: int = wait(formed, timeout, what, self.tail)
        return epoch

    def wait_steps(self, steps: int, timeout: float, what: str) -> None:
        start = self.committed_step()
        wait(lambda: self.committed_step() >= start + steps, timeout, what, self.tail)

    def tail(self) -> str:
        lines = []
        for role in ("launcher", "worker"):
            for name in sorted(self.pods(role)):
                text = self.kubelet.log(self.namespace, name)
                lines.append(f"--- {name}:\n" + "\n".join(text.splitlines()[-15:]))
        return "\n".join(lines)


def test_a_rendered_job_trains_through_a_deletion_a_preemption_and_a_new_launcher(  # noqa: PLR0917
    kube_cluster: KubeCluster,
    kube: Kube,
    kubelet: KubeletClient,
    namespace: str,
    pod_etcd: str,
    etcd_server: EmbeddedEtcd,
    urgent_class: str,
    room: None,
    tmp_path: Path,
) -> None:
    job_id = fresh_job_id("kj")
    stop_file = tmp_path / "stop"
    flags = ("--workers", "3", "--min-workers", "2", "--max-workers", "3", "--max-restarts", "6")
    kube_cluster.kubectl(
        "apply", "-f", "-", input=render(namespace, pod_etcd, job_id, *flags, stop_file=stop_file)
    )
    with EtcdStore(etcd_server.endpoints_text, job_id) as store:
        job = JobWatch(kube, kubelet, namespace, store)

        # 1. Three workers train; the cluster has no room for a fourth.
        epoch = job.wait_size(3, 0, 180, "three workers training")
        job.wait_steps(20, 60, "steps at size 3")
        workers = job.running("worker")
        assert len(workers) == 3
        nodes = {p["spec"]["nodeName"] for p in workers.values()}
        assert len(nodes) == 2, nodes  # placed by the scheduler on both nodes
        (launcher,) = job.running("launcher")

        # 2. A worker pod deleted: a graceful leave (SIGTERM to its agent), then a replacement.
        deleted = sorted(workers)[-1]
        kube_cluster.kubectl("delete", "pod", deleted, "-n", namespace, "--wait=false")
        epoch = job.wait_size(2, epoch, 120, "the ring without the deleted worker")
        epoch = job.wait_size(3, epoch, 180, "the replacement worker joined")
        assert deleted not in job.pods("worker")
        # Seen through the API as a pod being deleted: a resize, nobody rolled back.
        log = kubelet.log(namespace, launcher)
        assert f"node {deleted} was lost: pod is being deleted" in log, job.tail()
        assert "(resize): 2 ranks" in log and "(failure)" not in log, job.tail()

        # 2b. A worker's container killed (SIGKILL of `elastic-run join`, its training process
        # with it): the kubelet reports the pod Failed, a crash epoch, and a replacement.
        workers = job.running("worker")
        killed = sorted(workers)[0]
        agent_pid = job.snapshot().members[killed].record.pid
        assert agent_pid is not None
        os.kill(agent_pid, signal.SIGKILL)
        epoch = job.wait_size(2, epoch, 120, "the ring without the killed worker")
        epoch = job.wait_size(3, epoch, 180, "a replacement for the killed worker")
        log = kubelet.log(namespace, launcher)
        assert f"node {killed} was lost: pod failed" in log, job.tail()
        assert "(failure): 2 ranks" in log, job.tail()

        # 3. A higher-priority pod that fits only where a worker runs: the scheduler preempts it.
        before = set(job.running("worker"))
        intruder = intruder_pod(urgent_class)
        arrived = time.monotonic()
        kube.request("POST", POD, namespace, body=intruder)
        epoch = job.wait_size(2, epoch, 180, "the ring without the preempted worker")
        shrunk = time.monotonic()
        preempted = sorted(before - set(job.running("worker")))
        assert len(preempted) == 1, (before, job.pods("worker").keys())
        events = kube.list(EVENT, namespace, "")
        said = [
            e
            for e in events
            if e.get("reason") == "Preempted"
            and e.get("involvedObject", {}).get("name") == preempted[0]
        ]
        assert said, [(e.get("reason"), e.get("message")) for e in events]
        assert "default-scheduler" in json.dumps(said[0])
        # Trains on at two, while the replacement waits for room.
        job.wait_steps(20, 60, "steps at size 2 after the preemption")
        pending = [
            p for p in job.pods("worker").values() if p.get("status", {}).get("phase") == "Pending"
        ]
        assert len(pending) == 1 and job.running_ring() is not None
        assert len(job.running_ring()[1]) == 2  # type: ignore[index]
        # Room again: the pending worker is placed and joins.
        kube.request("DELETE", POD, namespace, "intruder")
        gone = time.monotonic()
        epoch = job.wait_size(3, epoch, 180, "the job grown back to three")
        print(
            f"preemption: intruder created -> ring of 2 training {shrunk - arrived:.1f} s; "
            f"intruder deleted -> ring of 3 training {time.monotonic() - gone:.1f} s"
        )

        # The launcher told the story as Events on its pod, through the real API.
        told = [
            e
            for e in kube.list(EVENT, namespace, "")
            if e.get("involvedObject", {}).get("name") == launcher
        ]
        reasons = {e.get("reason") for e in told}
        assert {"Joined", "Left", "Crashed", "Reformed"} <= reasons, [
            (e.get("reason"), e.get("message")) for e in told
        ]
        assert any(e.get("type") == "Warning" and killed in e.get("message", "") for e in told)
        launcher_pod = kube.get(POD, launcher, namespace)
        assert launcher_pod is not None
        assert all(e["involvedObject"].get("uid") == launcher_pod["metadata"]["uid"] for e in told)
        # ... and keeps the ring on its pod's annotation.
        annotations = launcher_pod["metadata"].get("annotations", {})
        assert annotations.get("elastic-allreduce/ring", "").startswith("epoch "), annotations

        # 4. The launcher pod deleted: it hands over, the Job's next pod adopts the job.
        kube_cluster.kubectl("delete", "pod", launcher, "-n", namespace, "--wait=false")
        wait(
            lambda: [n for n in job.running("launcher") if n != launcher],
            120,
            "the launcher Job's next pod",
            job.tail,
        )
        (successor,) = [n for n in job.running("launcher") if n != launcher]
        kubelet.wait_for_log(namespace, successor, "taking over job", timeout=120)
        job.wait_steps(20, 90, "steps under the new launcher")
        assert job.running_ring() is not None and job.running_ring()[0] == epoch  # type: ignore[index]

        # 5. Stop: every rank finishes, the Job completes, the worker pods are deleted.
        stop_file.write_text("stop")
        wait(
            lambda: job_condition(kube, namespace, f"{job_id}-launcher", "Complete"),
            180,
            "the launcher Job to complete",
            job.tail,
        )
        status = job.snapshot().status
        assert status is not None and status.record.phase is JobPhase.SUCCEEDED
        wait(lambda: not job.pods("worker"), 120, "the worker pods to be deleted")


def test_deleting_the_launcher_job_garbage_collects_its_worker_pods(  # noqa: PLR0917
    kube_cluster: KubeCluster,
    kube: Kube,
    kubelet: KubeletClient,
    namespace: str,
    pod_etcd: str,
    etcd_server: EmbeddedEtcd,
    room: None,
    tmp_path: Path,
) -> None:
    job_id = fresh_job_id("kg")
    flags = ("--workers", "2", "--min-workers", "1", "--max-workers", "2")
    text = render(namespace, pod_etcd, job_id, *flags, stop_file=tmp_path / "stop")
    kube_cluster.kubectl("apply", "-f", "-", input=text)
    with EtcdStore(etcd_server.endpoints_text, job_id) as store:
        job = JobWatch(kube, kubelet, namespace, store)
        job.wait_size(2, 0, 180, "two workers training")
        workers = job.pods("worker")
        owners = {
            ref["kind"]
            for pod in workers.values()
            for ref in pod["metadata"].get("ownerReferences", [])
        }
        assert owners == {"Job"}, owners
        # Background propagation: the garbage collector deletes the Job's dependents. The
        # launcher's pod, on SIGTERM, hands the job over and deletes nothing itself.
        kube_cluster.kubectl(
            "delete", "job", f"{job_id}-launcher", "-n", namespace, "--cascade=background"
        )
        wait(
            lambda: not job.pods("worker") and not job.pods("launcher"),
            120,
            "the garbage collector to delete the worker pods",
            job.tail,
        )


def intruder_pod(priority_class: str) -> Obj:
    """A pod of a higher priority than the workers' that needs 3 CPUs: it fits only on a node
    from which a worker is preempted."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "intruder"},
        "spec": {
            "priorityClassName": priority_class,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "sleeper",
                    "image": "sleeper",
                    "command": ["python", "-c", "import time; time.sleep(3600)"],
                    "resources": {"requests": {"cpu": "3", "memory": "100Mi"}},
                }
            ],
        },
    }


def job_condition(kube: Kube, namespace: str, name: str, condition: str) -> bool:
    job = kube.get(JOB, name, namespace)
    conditions = [] if job is None else job.get("status", {}).get("conditions", [])
    return any(c["type"] == condition and c["status"] == "True" for c in conditions)
