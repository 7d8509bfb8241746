"""KubernetesProvisioner against the fake API (no pods run here: the test plays the kubelet by
writing pod status, as a cluster would)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from kubernetes import client

from elastic_allreduce import env
from elastic_allreduce.errors import ConfigError, UnavailableError
from elastic_allreduce.records.values import MemberRecord
from launcher.k8s.client import Kube
from launcher.k8s.errors import KubernetesApiError
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from launcher.k8s.retry import Backoff
from launcher.provisioners.api import NodeStates
from tests.helpers.fake_kube import FakeKube, Fault, quota_message
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
        fake_kube.wait_for(
            lambda: any("watch=true" in path for _, path in fake_kube.requests), 10, "a watch"
        )
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
        fake_kube.wait_for(
            lambda: any("watch=true" in path for _, path in fake_kube.requests),
            10,
            "the provisioner watching its pods",
        )
        assert provisioner.node_states().disrupted == {}
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


def create_requests(fake_kube: FakeKube) -> int:
    """How many pod creates the fake has seen."""
    return sum(
        1 for method, path in fake_kube.requests if method == "POST" and path.endswith("/pods")
    )


FAST = {
    "retry_backoff": Backoff(first=0.05, cap=0.2),
    "refused_backoff": Backoff(first=0.1, cap=0.3),
}


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and text in r.getMessage()
    ]


@pytest.mark.parametrize("quota", [False, True], ids=["rbac", "quota"])
def test_a_refused_create_is_said_once_and_the_pod_is_created_once_allowed(
    fake_kube: FakeKube, kube: Kube, caplog: pytest.LogCaptureFixture, quota: bool
) -> None:
    fake_kube.deny("create", "pods", quota_message("train-a-worker-0") if quota else None)
    provisioner = make(kube, **FAST)
    try:
        watcher = Watcher(provisioner)
        with caplog.at_level(logging.INFO):
            # The launcher is not held up, nor failed: the node is pending until it can start.
            (name,) = provisioner.start_nodes(1)
            assert provisioner.node_states().pending == {name}
            fake_kube.wait_for(lambda: create_requests(fake_kube) >= 4, 10, "4 refused creates")
            assert fake_kube.pod(name) is None
            (said,) = warnings_with(caplog, "cannot create worker pods")
            assert "refused to create pods in namespace 'default'" in said
            if quota:
                assert "exceeded quota: compute" in said
                assert "ResourceQuota is used up" in said
            else:
                assert "The launcher's Role allows create on pods" in said
                assert "k8s/" in said
            assert "The job goes on with the nodes it has" in said
            fake_kube.allow("create", "pods")
            watcher.wait(lambda s: not s.pending and name not in s.dead, "the pod to be created")
            fake_kube.wait_for(
                lambda: any("allowed again" in r.getMessage() for r in caplog.records),
                5,
                "the end of the problem to be said",
            )
        assert fake_kube.pod(name) is not None
        assert len(warnings_with(caplog, "cannot create worker pods")) == 1
        assert provisioner.node_states().disrupted == {}
    finally:
        provisioner.close()


def test_transient_create_failures_are_retried_and_a_lost_answer_makes_no_duplicate(
    fake_kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    fake_kube.inject(
        "create",
        "pods",
        Fault(500),
        Fault(drop=True),  # no answer at all
        Fault(delay=1.0),  # beyond the client's read timeout
        Fault(503, "ServiceUnavailable", after_apply=True),  # created, but the answer is lost
        Fault(429, "TooManyRequests"),
    )
    with fake_kube.kube(request_timeout=0.5) as kube:
        provisioner = make(kube, **FAST)
        try:
            watcher = Watcher(provisioner)
            with caplog.at_level(logging.INFO):
                (name,) = provisioner.start_nodes(1)
                watcher.wait(lambda s: not s.pending, "the pod to be created", timeout=20)
            pods = [p for p in fake_kube.pods() if p["metadata"]["name"].startswith("train-a")]
            assert [p["metadata"]["name"] for p in pods] == [name]
            assert provisioner.node_states().disrupted == {}
            assert len({f for verb, plural, f in fake_kube.faults_used if verb == "create"}) >= 4, (
                fake_kube.faults_used
            )
            (said,) = warnings_with(caplog, "creating a worker pod failed, retrying")
            assert "for up to 300 s" in said
            # The next pod gets the next name: nothing was taken for the retried one.
            assert provisioner.start_nodes(1) == ["train-a-worker-1"]
        finally:
            provisioner.close()


def test_a_create_that_fails_past_the_deadline_is_a_lost_node(
    fake_kube: FakeKube, kube: Kube
) -> None:
    fake_kube.inject("create", "pods", *[Fault(500)] * 200)
    provisioner = make(kube, api_deadline=0.5, **FAST)
    try:
        watcher = Watcher(provisioner)
        (name,) = provisioner.start_nodes(1)
        watcher.wait(lambda s: name in s.disrupted, "the node to be given up")
        reason = provisioner.node_states().disrupted[name]
        assert "could not be created" in reason and "HTTP 500" in reason
        assert name in provisioner.node_states().dead and fake_kube.pod(name) is None
    finally:
        provisioner.close()


def test_deletes_are_retried_through_transient_failures(fake_kube: FakeKube, kube: Kube) -> None:
    provisioner = make(kube, **FAST)
    try:
        watcher = Watcher(provisioner)
        stopped, kept, closed = provisioner.start_nodes(3)
        fake_kube.inject("delete", "pods", Fault(500), Fault(drop=True), Fault(504))
        provisioner.stop_node(stopped)  # scale-down: not held up by the failures
        watcher.wait(lambda s: stopped in s.dead, "the stopped pod to go")
        assert fake_kube.faults_left("delete", "pods") == 0
        assert provisioner.node_states().disrupted == {}
        fake_kube.inject("delete", "pods", Fault(503), Fault(503))
    finally:
        provisioner.close()  # close retries its deletes too
    assert fake_kube.pod(kept) is None and fake_kube.pod(closed) is None


def test_the_watch_survives_failures_and_says_so_once(
    fake_kube: FakeKube, api: client.ApiClient, kube: Kube, caplog: pytest.LogCaptureFixture
) -> None:
    provisioner = make(kube, **FAST)
    try:
        watcher = Watcher(provisioner)
        (name,) = provisioner.start_nodes(1)
        with caplog.at_level(logging.INFO):
            fake_kube.inject("watch", "pods", Fault(500), Fault(503), Fault(drop=True))
            fake_kube.drop_watches()
            fake_kube.wait_for(lambda: fake_kube.faults_left("watch", "pods") == 0, 10, "faults")
            set_status(api, name, {"phase": "Failed", "reason": "Evicted", "message": "disk"})
            watcher.wait(lambda s: name in s.disrupted, "the eviction seen after the failures")
        assert len(warnings_with(caplog, "the pod watch failed, retrying")) == 1
    finally:
        provisioner.close()


def test_worker_pods_belong_to_the_launchers_job_and_go_with_it(
    fake_kube: FakeKube, kube: Kube
) -> None:
    job = fake_kube_job(fake_kube)
    provisioner = make(
        kube, launcher_job_name="train-a-launcher", launcher_job_uid=job["metadata"]["uid"]
    )
    try:
        names = provisioner.start_nodes(2)
        for name in names:
            pod = fake_kube.pod(name)
            assert pod is not None
            # Not a controller reference: the Job controller would release a pod that its
            # selector does not match. No blockOwnerDeletion: that needs rights on the Job.
            assert pod["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "train-a-launcher",
                    "uid": job["metadata"]["uid"],
                }
            ]
        provisioner.release()  # a launcher pod hands over: the pods stay
        assert all(fake_kube.pod(name) is not None for name in names)
        with fake_kube.api_client() as api:
            client.BatchV1Api(api).delete_namespaced_job("train-a-launcher", "default")
        fake_kube.wait_for(
            lambda: not any(fake_kube.pod(name) for name in names), 10, "garbage collection"
        )
    finally:
        provisioner.close()


def fake_kube_job(fake_kube: FakeKube) -> dict[str, Any]:
    """The launcher's Job, as `kubectl apply` would create it (the fake runs no Job)."""
    with fake_kube.api_client() as api:
        body = {
            "metadata": {"name": "train-a-launcher"},
            "spec": {"template": {"spec": {"containers": [{"name": "launcher"}]}}},
        }
        created = client.BatchV1Api(api).create_namespaced_job("default", body)
        return dict(api.sanitize_for_serialization(created))


def test_a_later_launcher_of_the_same_job_adopts_its_pods(
    fake_kube: FakeKube, api: client.ApiClient, kube: Kube
) -> None:
    owner = {"launcher_job_name": "train-a-launcher", "launcher_job_uid": "uid-of-the-job"}
    first = make(kube, launcher_pod_uid="uid-of-pod-1", **owner)
    lost, stopped, kept, dead = first.start_nodes(4)
    set_status(api, dead, {"phase": "Failed", "reason": "Error"})  # died before the takeover
    foreign = {
        "metadata": {
            "name": "train-a-worker-9",
            "labels": {"elastic-allreduce/job": JOB, "elastic-allreduce/role": "worker"},
        },
        "spec": {"containers": [{"name": "x"}]},
    }
    client.CoreV1Api(api).create_namespaced_pod("default", foreign)  # not the Job's
    first.release()  # the launcher pod hands the job over; its pods keep running
    second = make(kube, launcher_pod_name="train-a-launcher-2", launcher_pod_uid="uid-2", **owner)
    try:
        # The members the launcher read from the store: the Job's live pods are managed from
        # now on (replaced when lost); a node that joined by itself, or a pod of another owner
        # with the job's labels, is not.
        members = {n: MemberRecord("10.0.0.1", 1, 7) for n in (lost, stopped, kept, "j1")}
        members["train-a-worker-9"] = MemberRecord("10.0.0.2", 1, 7)
        assert second.adopt(members) == {lost, stopped, kept}
        watcher = Watcher(second)  # a launcher subscribes as it starts to lead: it adopts
        watcher.wait(lambda s: dead in s.dead, "the adopted pods to be known")
        assert second.node_states().disrupted == {}  # the dead one was handled before
        assert second.node_states().pending == frozenset()
        # A loss of an adopted pod is reported, a scale-down deletes it.
        set_status(api, lost, {"phase": "Failed", "reason": "Evicted", "message": "disk"})
        watcher.wait(lambda s: lost in s.disrupted, "the adopted pod's loss")
        assert second.node_states().disrupted == {lost: "pod evicted (disk)"}
        second.stop_node(stopped)
        watcher.wait(lambda s: stopped in s.dead, "the adopted pod to be stopped")
        assert fake_kube.pod(stopped) is None
        assert second.node_states().disrupted == {lost: "pod evicted (disk)"}
        # New pods get names no pod has: no 409 on the way.
        posts = create_requests(fake_kube)
        assert second.start_nodes(1) == ["train-a-worker-4"]
        assert create_requests(fake_kube) == posts + 1
    finally:
        second.close()
    # At the end of the job it deletes what it adopted; the other Job's pod stays.
    assert [p["metadata"]["name"] for p in fake_kube.pods()] == ["train-a-worker-9"]
    assert fake_kube.pod(kept) is None and fake_kube.pod(dead) is None


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
    with Kube(client.ApiClient(configuration)) as dead:
        # Weather, up to the deadline: the node waits (pending), then it is lost, saying why.
        provisioner = KubernetesProvisioner(
            replace(settings, namespace="default", api_deadline=0.5, **FAST), dead
        )
        try:
            watcher = Watcher(provisioner)
            (name,) = provisioner.start_nodes(1)
            watcher.wait(lambda s: name in s.disrupted, "the node to be given up")
            reason = provisioner.node_states().disrupted[name]
            assert "could not be created for" in reason, reason
            assert "cannot reach the Kubernetes API" in reason, reason
            assert isinstance(provisioner.watch_error, UnavailableError)
        finally:
            provisioner.close()


def test_a_template_that_is_not_a_pod_is_refused(kube: Kube) -> None:
    bad = {"kind": "Deployment", "spec": {"template": {}}}
    settings = KubernetesSettings(namespace="default", job_id=JOB, etcd="e:1", worker_template=bad)
    with pytest.raises(ConfigError, match="must be a Pod manifest"):
        KubernetesProvisioner(settings, kube)
