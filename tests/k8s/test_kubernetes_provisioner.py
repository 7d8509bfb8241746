"""KubernetesProvisioner against the fake API (no pods run here: the test plays the kubelet by
writing pod status, as a cluster would)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError, UnavailableError
from launcher.k8s.client import Kube
from launcher.k8s.errors import KubernetesApiError
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from launcher.provisioners.api import NodeStates
from tests.helpers.fake_kube import FakeKube
from tests.k8s.conftest import join_template

JOB = "train-a"


class Watcher:
    """Waits, with deadlines, for the provisioner's reported node states."""

    def __init__(self, provisioner: KubernetesProvisioner) -> None:
        self.provisioner = provisioner
        self.changed = threading.Condition()
        self.calls = 0
        provisioner.subscribe(self._on_change)

    def _on_change(self) -> None:
        with self.changed:
            self.calls += 1
            self.changed.notify_all()

    def wait(self, predicate: Callable[[NodeStates], bool], what: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(self.provisioner.node_states()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"timed out waiting for {what}: {self.provisioner.node_states()}"
                    )
                self.changed.wait(min(remaining, 0.5))


def gpu_template() -> dict[str, Any]:
    template = join_template(
        env=[{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": env.JOB_ID, "value": "stale"}],
        resources={"limits": {"nvidia.com/gpu": 2, "memory": "8Gi"}},
    )
    template["spec"].update(
        nodeSelector={"accelerator": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        priorityClassName="training-low",
        restartPolicy="Always",
    )
    return template


def make(kube: Kube, template: dict[str, Any] | None = None, **extra: Any) -> KubernetesProvisioner:
    settings = KubernetesSettings(
        namespace="default",
        job_id=JOB,
        etcd="10.0.0.5:2379",
        worker_template=template or gpu_template(),
        launcher_pod_name=extra.pop("launcher_pod_name", "train-a-launcher"),
        launcher_pod_uid=extra.pop("launcher_pod_uid", "uid-of-launcher"),
        **extra,
    )
    return KubernetesProvisioner(settings, kube)


@pytest.fixture
def api(fake_kube: FakeKube) -> Iterator[client.ApiClient]:
    """The official client: the test's own hands on the cluster (as kubectl would be)."""
    with fake_kube.api_client() as api_client:
        yield api_client


@pytest.fixture
def kube(fake_kube: FakeKube) -> Iterator[Kube]:
    """The launcher's client, for the provisioner."""
    with fake_kube.kube() as launcher_client:
        yield launcher_client


@pytest.fixture
def provisioner(kube: Kube) -> Iterator[KubernetesProvisioner]:
    made = make(kube)
    yield made
    made.close()


def set_status(api: client.ApiClient, name: str, status: dict[str, Any]) -> None:
    client.CoreV1Api(api).patch_namespaced_pod_status(name, "default", {"status": status})


def test_worker_pods_carry_labels_env_resources_scheduling_and_owner(
    fake_kube: FakeKube, provisioner: KubernetesProvisioner
) -> None:
    (name,) = provisioner.start_nodes(1)
    assert name == "train-a-worker-0"
    pod = fake_kube.pod(name)
    assert pod is not None
    labels = pod["metadata"]["labels"]
    assert labels == {
        "team": "ml",
        "app.kubernetes.io/name": "elastic-allreduce",
        "elastic-allreduce/job": JOB,
        "elastic-allreduce/role": "worker",
    }
    assert pod["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "train-a-launcher",
            "uid": "uid-of-launcher",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"  # the launcher replaces pods, not the kubelet
    assert spec["nodeSelector"] == {"accelerator": "h100"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["priorityClassName"] == "training-low"
    assert spec["terminationGracePeriodSeconds"] == 20
    container = spec["containers"][0]
    assert container["command"] == ["elastic-run", "join"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2", "memory": "8Gi"}
    variables = {e["name"]: e for e in container["env"]}
    assert variables["NCCL_DEBUG"]["value"] == "WARN"
    assert variables[env.ETCD_ENDPOINTS]["value"] == "10.0.0.5:2379"
    assert variables[env.JOB_ID]["value"] == JOB  # ours wins over the template's
    assert [e["name"] for e in container["env"]].count(env.JOB_ID) == 1
    assert variables[env.NODE_ID]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert variables[env.HOST]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert variables[env.PROVISIONED]["value"] == "1"  # a replacement skips the max check


def test_gpus_per_node_sets_the_gpu_limit(fake_kube: FakeKube, kube: Kube) -> None:
    provisioner = make(kube, join_template(), gpus_per_node=4)
    try:
        (name,) = provisioner.start_nodes(1)
        resources = fake_kube.pod(name)["spec"]["containers"][0]["resources"]  # type: ignore[index]
        assert resources["limits"]["nvidia.com/gpu"] == "4"
        assert resources["requests"]["nvidia.com/gpu"] == "4"
    finally:
        provisioner.close()


def test_a_taken_name_is_skipped(fake_kube: FakeKube, api: client.ApiClient, kube: Kube) -> None:
    leftover = {"metadata": {"name": "train-a-worker-0"}, "spec": {"containers": [{"name": "x"}]}}
    client.CoreV1Api(api).create_namespaced_pod("default", leftover)
    provisioner = make(kube)
    try:
        assert provisioner.start_nodes(2) == ["train-a-worker-1", "train-a-worker-2"]
    finally:
        provisioner.close()
    assert fake_kube.pod("train-a-worker-0") is not None  # not ours: left alone


def test_pending_pods_and_lost_pods_are_reported(
    fake_kube: FakeKube, api: client.ApiClient, provisioner: KubernetesProvisioner
) -> None:
    watcher = Watcher(provisioner)
    unschedulable = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
    }
    evicted, failed, deleted, running = provisioner.start_nodes(4)
    set_status(api, running, unschedulable)
    watcher.wait(lambda s: s.pending == {running}, "an unschedulable pod")
    set_status(api, running, {"phase": "Running", "conditions": []})
    watcher.wait(lambda s: not s.pending, "the pod to be placed")
    # Placed, its image still being pulled: not started either (no duplicate pod meanwhile).
    pulling = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {
                "name": "worker",
                "state": {"waiting": {"reason": "ContainerCreating"}},
                "image": "elastic-allreduce:dev",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
            }
        ],
    }
    set_status(api, running, pulling)
    watcher.wait(lambda s: s.pending == {running}, "a pod whose image is being pulled")
    set_status(api, running, {"phase": "Running", "conditions": []})
    watcher.wait(lambda s: not s.pending, "the pod to start")

    set_status(api, evicted, {"phase": "Failed", "reason": "Evicted", "message": "low memory"})
    terminated = {"terminated": {"exitCode": 137, "reason": "Error"}}
    set_status(
        api,
        failed,
        {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "worker",
                    "state": terminated,
                    "image": "elastic-allreduce:dev",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                }
            ],
        },
    )
    client.CoreV1Api(api).delete_namespaced_pod(deleted, "default")
    watcher.wait(lambda s: len(s.disrupted) == 3, "three lost pods")
    disrupted = provisioner.node_states().disrupted
    assert disrupted[evicted] == "pod evicted (low memory)"
    assert disrupted[failed] == "pod failed: container worker exited with code 137 (Error)"
    assert "delet" in disrupted[deleted]
    assert provisioner.node_states().dead >= {evicted, failed, deleted}
    assert running not in disrupted


def test_stop_node_deletes_the_pod_and_is_not_a_loss(
    fake_kube: FakeKube, provisioner: KubernetesProvisioner
) -> None:
    watcher = Watcher(provisioner)
    stopped, kept = provisioner.start_nodes(2)
    provisioner.stop_node(stopped)
    watcher.wait(lambda s: stopped in s.dead, "the stopped pod to go")
    assert fake_kube.pod(stopped) is None and fake_kube.pod(kept) is not None
    assert provisioner.node_states().disrupted == {}
    provisioner.stop_node("not-a-node")  # unknown: nothing to do


def test_the_watch_resumes_from_its_resource_version(
    fake_kube: FakeKube, api: client.ApiClient, kube: Kube
) -> None:
    provisioner = make(kube, watch_timeout=2)
    try:
        watcher = Watcher(provisioner)
        (name,) = provisioner.start_nodes(1)
        fake_kube.drop_watches()  # as the server does when a watch times out
        set_status(api, name, {"phase": "Failed", "reason": "Evicted", "message": "disk"})
        watcher.wait(lambda s: name in s.disrupted, "the eviction seen after the resume")
        assert provisioner.relists == 1
        watches = [path for method, path in fake_kube.requests if "watch=true" in path]
        assert len(watches) >= 2
        assert all("resourceVersion=" in path for path in watches)
    finally:
        provisioner.close()


def test_410_gone_makes_it_list_again_and_catch_up(
    fake_kube: FakeKube, api: client.ApiClient, kube: Kube
) -> None:
    provisioner = make(kube)
    try:
        watcher = Watcher(provisioner)
        first, second = provisioner.start_nodes(2)
        watcher.wait(lambda s: True, "nothing")
        fake_kube.deny("watch", "pods")  # keep the provisioner from watching for a moment
        fake_kube.drop_watches()
        fake_kube.wait_for(lambda: provisioner.watch_error is not None, 10, "a refused watch")
        assert "refused to watch pods in namespace 'default'" in str(provisioner.watch_error)
        # While it could not watch: one pod is deleted, and history is compacted.
        client.CoreV1Api(api).delete_namespaced_pod(first, "default", grace_period_seconds=0)
        fake_kube.compact()
        fake_kube.allow("watch", "pods")
        watcher.wait(lambda s: first in s.disrupted, "the deletion found by the re-list", 20)
        assert provisioner.relists == 2
        assert second not in provisioner.node_states().disrupted
    finally:
        provisioner.close()


def test_close_deletes_every_pod_it_created_and_is_idempotent(
    fake_kube: FakeKube, kube: Kube
) -> None:
    provisioner = make(kube)
    names = provisioner.start_nodes(3)
    provisioner.close()
    assert not any(fake_kube.pod(name) for name in names)
    provisioner.close()


def test_rbac_refusals_say_what_is_forbidden_and_how_to_fix_it(
    fake_kube: FakeKube, kube: Kube
) -> None:
    fake_kube.deny("create", "pods")
    provisioner = make(kube)
    try:
        with pytest.raises(KubernetesApiError) as raised:
            provisioner.start_nodes(1)
        message = str(raised.value)
        assert raised.value.status == 403
        assert not isinstance(raised.value, ConfigError)  # operational: exit code 3
        assert "refused to create pods in namespace 'default'" in message
        assert "The launcher's Role allows create on pods" in message
        assert "k8s/" in message
    finally:
        provisioner.close()


def test_a_missing_namespace_and_an_unreachable_api_are_clear_errors(kube: Kube) -> None:
    settings = KubernetesSettings(
        namespace="nope", job_id=JOB, etcd="e:1", worker_template=join_template()
    )
    with pytest.raises(KubernetesApiError, match=r"namespace 'nope'.*404"):
        KubernetesProvisioner(settings, kube).start_nodes(1)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = 0
    with (
        Kube(client.ApiClient(configuration)) as dead,
        pytest.raises(KubernetesApiError, match="cannot reach the Kubernetes API") as raised,
    ):
        KubernetesProvisioner(settings, dead).start_nodes(1)
    assert isinstance(raised.value, UnavailableError)


def test_a_template_that_is_not_a_pod_is_refused(kube: Kube) -> None:
    bad = {"kind": "Deployment", "spec": {"template": {}}}
    settings = KubernetesSettings(namespace="default", job_id=JOB, etcd="e:1", worker_template=bad)
    with pytest.raises(ConfigError, match="must be a Pod manifest"):
        KubernetesProvisioner(settings, kube)
