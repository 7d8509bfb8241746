"""The launcher's PodDisruptionBudget against the real API server and disruption controller.

``elastic-run k8s render --launcher-pdb`` adds a PodDisruptionBudget (minAvailable 1) over the
job's launcher pod so that a voluntary eviction (a drain) waits until the job ends. Here the
budget is taken from that command's output and applied with a pod carrying the labels of the
rendered launcher Job's pod; the real disruption controller computes the budget's status and the
Eviction API (``POST pods/<name>/eviction``, policy/v1) refuses to evict the launcher with 429
and the controller's reason naming the budget, while the pod keeps running. Without the budget
the same eviction is accepted and the process kubelet gives the pod its SIGTERM. A worker pod
of the same job (PriorityClass elastic-allreduce-preemptible) is not covered by the launcher's
budget: it is evicted while the budget holds the launcher.

The PriorityClasses of k8s/base/priorityclass.yaml are applied (cluster-scoped, left in place:
other modules apply the same objects).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.k8s.client import Kind, Kube
from launcher.k8s.naming import TEMPLATE_KEY, launcher_name
from tests.conftest import ROOT, fresh_job_id
from tests.helpers.kube.cluster import KubeCluster
from tests.helpers.kube.kubelet import KubeletClient
from tests.kube.conftest import POD, wait
from tests.kube.test_kubelet import SLEEPER, pod_manifest, running, watch_until

pytestmark = pytest.mark.timeout(180)

PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
PRIORITY_CLASSES = ROOT / "k8s" / "base" / "priorityclass.yaml"
ELASTIC_RUN = str(Path(sys.executable).parent / "elastic-run")
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def priority_classes(kube_cluster: KubeCluster) -> None:
    """The workers' and the launchers' PriorityClasses, as the kustomize base has them."""
    kube_cluster.kubectl("apply", "-f", str(PRIORITY_CLASSES))


def render(job_id: str, namespace: str) -> list[Obj]:
    """The objects ``elastic-run k8s render --launcher-pdb`` prints for a job."""
    done = subprocess.run(
        [
            *(ELASTIC_RUN, "k8s", "render", "--launcher-pdb", "--etcd-plaintext"),
            *("--image", "elastic-allreduce:dev", "--job-id", job_id, "--namespace", namespace),
            *("--", "python", "train.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(objects: list[Obj], kind: str) -> Obj:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def launcher_pod(objects: list[Obj], name: str) -> Obj:
    """A pod with the rendered launcher Job pod's labels and PriorityClass that runs SLEEPER
    (it prints "ready", and "got SIGTERM" when it gets one)."""
    template = one(objects, "Job")["spec"]["template"]
    pod = pod_manifest(name, SLEEPER)
    pod["metadata"]["labels"] = dict(template["metadata"]["labels"])
    pod["spec"]["priorityClassName"] = template["spec"]["priorityClassName"]
    return pod


def worker_pod(objects: list[Obj], name: str) -> Obj:
    """A pod with the rendered worker template's labels and PriorityClass that runs SLEEPER."""
    template = yaml.safe_load(one(objects, "ConfigMap")["data"][TEMPLATE_KEY])
    pod = pod_manifest(name, SLEEPER)
    pod["metadata"]["labels"] = dict(template["metadata"]["labels"])
    pod["spec"]["priorityClassName"] = template["spec"]["priorityClassName"]
    return pod


def start(kube: Kube, kubelet: KubeletClient, namespace: str, pod: Obj) -> Obj:
    """Create ``pod`` and return it once it runs and its process has said "ready"."""
    kube.request("POST", POD, namespace, body=pod)
    name = pod["metadata"]["name"]
    running(kube, namespace, name)
    kubelet.wait_for_log(namespace, name, "ready")
    return kube.get(POD, name, namespace) or {}


def evict(cluster: KubeCluster, namespace: str, name: str) -> tuple[int, Obj]:
    """POST a policy/v1 Eviction of pod ``name``: the HTTP status and the answer's body."""
    status, body = cluster.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods/{name}/eviction",
        {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        },
    )
    return status, json.loads(body)


def budget_settled(kube: Kube, namespace: str, name: str, healthy: int) -> bool:
    """Whether the disruption controller has computed the budget's status for its current
    generation, counting ``healthy`` healthy pods and allowing no disruption."""
    budget = kube.get(PDB, name, namespace) or {}
    status = budget.get("status") or {}
    return (
        status.get("observedGeneration") == budget["metadata"]["generation"]
        and status.get("currentHealthy") == healthy
        and status.get("expectedPods") == healthy
        and status.get("disruptionsAllowed") == 0
    )


def gone(kube: Kube, namespace: str, name: str) -> None:
    watch_until(
        kube, POD, namespace, name, lambda p: p is None, timeout=60.0, what=f"pod {name} to go"
    )


def launcher_under_budget(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> tuple[str, list[Obj]]:
    """A job's rendered launcher PDB and a running pod shaped as its launcher, counted by the
    disruption controller; the job id and the rendered objects."""
    job_id = fresh_job_id("pdb")
    objects = render(job_id, namespace)
    budget = one(objects, "PodDisruptionBudget")
    assert budget["metadata"]["name"] == launcher_name(job_id)
    kube.request("POST", PDB, namespace, body=budget)
    pod = start(kube, kubelet, namespace, launcher_pod(objects, "launcher"))
    assert pod["spec"]["priority"] == 1000  # elastic-allreduce-launcher
    wait(
        lambda: budget_settled(kube, namespace, launcher_name(job_id), healthy=1),
        30.0,
        "the disruption controller to count the launcher in its budget",
    )
    return job_id, objects


def test_the_budget_refuses_to_evict_the_launcher_and_without_it_the_eviction_happens(
    kube_cluster: KubeCluster,
    kube: Kube,
    kubelet: KubeletClient,
    namespace: str,
    priority_classes: None,
) -> None:
    job_id, _ = launcher_under_budget(kube, kubelet, namespace)

    status, answer = evict(kube_cluster, namespace, "launcher")
    assert status == 429, answer
    assert answer["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    [cause] = answer["details"]["causes"]
    assert cause["reason"] == "DisruptionBudget"
    assert cause["message"] == (
        f"The disruption budget {launcher_name(job_id)} needs 1 healthy pods and has 1 currently"
    )
    # Refused: the pod is not being deleted and its process never saw a SIGTERM.
    after = kube.get(POD, "launcher", namespace) or {}
    assert "deletionTimestamp" not in after["metadata"]
    assert after["status"]["phase"] == "Running"
    assert "running" in after["status"]["containerStatuses"][0]["state"]
    assert "got SIGTERM" not in kubelet.log(namespace, "launcher")

    kube.delete(PDB, launcher_name(job_id), namespace)
    status, answer = evict(kube_cluster, namespace, "launcher")
    assert status == 201, answer
    kubelet.wait_for_log(namespace, "launcher", "got SIGTERM")
    gone(kube, namespace, "launcher")


def test_a_worker_is_evicted_while_the_budget_holds_the_launcher(
    kube_cluster: KubeCluster,
    kube: Kube,
    kubelet: KubeletClient,
    namespace: str,
    priority_classes: None,
) -> None:
    job_id, objects = launcher_under_budget(kube, kubelet, namespace)
    worker = start(kube, kubelet, namespace, worker_pod(objects, "worker"))
    assert worker["spec"]["priority"] == -5  # elastic-allreduce-preemptible
    assert worker["metadata"]["labels"]["elastic-allreduce/job"] == job_id
    wait(
        lambda: budget_settled(kube, namespace, launcher_name(job_id), healthy=1),
        30.0,
        "the disruption controller to count the launcher (only) in its budget",
    )

    status, answer = evict(kube_cluster, namespace, "worker")
    assert status == 201, answer
    kubelet.wait_for_log(namespace, "worker", "got SIGTERM")
    gone(kube, namespace, "worker")
    # The launcher stays, still protected.
    status, answer = evict(kube_cluster, namespace, "launcher")
    assert status == 429, answer
    assert "got SIGTERM" not in kubelet.log(namespace, "launcher")
