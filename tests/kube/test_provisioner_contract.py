"""The provisioner contract (tests/k8s/test_provisioner_contract.py) against the real API server,
and what only a real cluster tells the Kubernetes provisioner.

The contract: the same test functions as for the local provisioner and the fake API, imported,
with one more subject: ``kubernetes-real``, a :class:`KubernetesProvisioner` connected with the
admin kubeconfig of the session's cluster, making worker pods in a namespace of the test's own.
The process kubelet runs each pod's ``elastic-run join`` as a process with the pod's own address
(``eth0``, the Gloo interface the shipped template names); the agents reach the session's etcd
through a forwarder at the control plane's address. A node "runs" while the kubelet reports its
pod's container running and that process exists.

Beyond the contract (twins of tests of tests/k8s/test_kubernetes_provisioner.py on the fake):
the real scheduler's Unschedulable for too many GPUs, a real Eviction, a SIGKILLed process and
a deletion by someone else reported as losses, each in its own words; the real 409 of a taken
name; a real ResourceQuota's and real RBAC's 403 said once and outlasted.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_allreduce import env
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from launcher.k8s.client import LAUNCHER_RBAC_ADVICE, Kind, Kube, connect
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from tests.conftest import fresh_job_id
from tests.helpers.kube.cluster import KubeCluster
from tests.k8s.conftest import (
    job_id,
    job_store,
    join_template,
    phase,
    store_view,
    write_job_config,
)
from tests.k8s.test_kubernetes_provisioner import FAST, Watcher, warnings_with
from tests.k8s.test_provisioner_contract import (
    COMMAND,
    Subject,
    test_close_stops_every_node_and_is_idempotent,
    test_started_nodes_register_in_the_store,
    test_stop_node_makes_one_node_leave_gracefully,
)
from tests.kube.conftest import GPUS_PER_NODE, POD, wait
from tests.kube.test_kubelet import SLEEPER, pod_manifest

# Imported tests and fixtures are collected and used from this module (with its own subject).
__all__ = [
    "job_id",
    "job_store",
    "store_view",
    "test_close_stops_every_node_and_is_idempotent",
    "test_started_nodes_register_in_the_store",
    "test_stop_node_makes_one_node_leave_gracefully",
]

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pod_etcd(kube_cluster: KubeCluster, etcd_server: EmbeddedEtcd) -> Iterator[str]:
    """The session's etcd as the pods reach it (``10.233.0.1:<port>``); the forwarder is
    stopped when the module ends."""
    endpoint, forwarder = kube_cluster.expose_to_pods(
        f"etcd-contract-{os.getpid()}", etcd_server.client_port
    )
    try:
        yield endpoint
    finally:
        forwarder.stop(10.0)
        kube_cluster.processes.pop(forwarder.name, None)


def _process_alive(container_id: str) -> bool:
    """Whether the process of a ``process://<pid>`` container exists (and is no zombie)."""
    pid = container_id.removeprefix("process://")
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(params=["kubernetes-real"])
def subject(
    kube_cluster: KubeCluster, namespace: str, pod_etcd: str, job_id: str, job_store: EtcdStore
) -> Iterator[Subject]:
    write_job_config(job_store, COMMAND)
    settings = KubernetesSettings(
        namespace=namespace,
        job_id=job_id,
        etcd=pod_etcd,
        worker_template=join_template(env=[{"name": env.GLOO_IFACE, "value": "eth0"}]),
    )
    api = connect(kubeconfig=str(kube_cluster.kubeconfig))

    def running(node: str) -> bool:
        pod = api.get(POD, node, namespace)
        statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
        return bool(statuses) and all(
            "running" in (s.get("state") or {}) and _process_alive(s.get("containerID", ""))
            for s in statuses
        )

    provisioner = KubernetesProvisioner(settings, api)
    try:
        yield Subject(provisioner, running)
    finally:
        provisioner.close()
        api.close()


# -- beyond the contract: what a real cluster tells the provisioner ---------------------------

QUOTA = Kind("v1", "ResourceQuota", "resourcequotas")
ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts")


def sleeper_settings(namespace: str, **extra: Any) -> KubernetesSettings:
    """Worker pods whose process waits for SIGTERM (no agent: only the pods matter here)."""
    template = join_template(command=["python", "-u", "-c", SLEEPER])
    return KubernetesSettings(
        namespace=namespace,
        job_id=fresh_job_id("real"),
        etcd="10.233.0.1:1",
        worker_template=template,
        **extra,
    )


def counting_creates(api: Kube) -> list[str]:
    """Record the name of every pod create ``api`` sends (answered or not)."""
    sent: list[str] = []
    create = api.create

    def counted(manifest: dict[str, Any]) -> dict[str, Any]:
        sent.append(manifest["metadata"]["name"])
        return create(manifest)

    api.create = counted  # type: ignore[method-assign]
    return sent


def test_real_pending_and_lost_pods_are_reported(
    kube_cluster: KubeCluster, kube: Kube, namespace: str
) -> None:
    """The real scheduler leaves a pod that asks for more GPUs than a node has Unschedulable;
    an eviction through the Eviction API, a SIGKILLed process and a deletion by someone else
    are losses, each said as what it was; a stop is not a loss."""
    api = connect(kubeconfig=str(kube_cluster.kubeconfig))
    provisioner = KubernetesProvisioner(sleeper_settings(namespace), api)
    greedy = KubernetesProvisioner(
        sleeper_settings(namespace, gpus_per_node=GPUS_PER_NODE + 1), api
    )
    try:
        watcher = Watcher(provisioner)
        evicted, killed, deleted, stopped, kept = provisioner.start_nodes(5)
        wait(
            lambda: all(
                phase(kube.get(POD, n, namespace)) == "Running"
                for n in [evicted, killed, deleted, stopped, kept]
            ),
            60.0,
            "the worker pods to run",
        )
        assert not provisioner.node_states().pending
        (waiting,) = greedy.start_nodes(1)
        greedy_watcher = Watcher(greedy)
        greedy_watcher.wait(lambda s: s.pending == {waiting}, "the scheduler to refuse a pod", 30)
        scheduled = next(
            c
            for c in (kube.get(POD, waiting, namespace) or {})["status"]["conditions"]
            if c["type"] == "PodScheduled"
        )
        assert "Insufficient nvidia.com/gpu" in scheduled["message"], scheduled

        status, body = kube_cluster.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods/{evicted}/eviction",
            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": evicted}},
        )
        assert status == 201, body
        container = (kube.get(POD, killed, namespace) or {})["status"]["containerStatuses"][0]
        os.kill(int(container["containerID"].removeprefix("process://")), signal.SIGKILL)
        kube.delete(POD, deleted, namespace)
        provisioner.stop_node(stopped)
        watcher.wait(lambda s: len(s.disrupted) == 3, "three lost pods", 60)
        watcher.wait(lambda s: {evicted, deleted, stopped} <= s.dead, "the deleted pods to go", 60)
        disrupted = provisioner.node_states().disrupted
        assert disrupted[evicted] == (
            "pod evicted through the Eviction API (a drain or the cluster autoscaler)"
        )
        assert disrupted[killed] == "pod failed: container worker exited with code 137 (Error)"
        assert disrupted[deleted] == "pod is being deleted"
        assert kept not in disrupted and stopped not in disrupted
        assert phase(kube.get(POD, kept, namespace)) == "Running"
        greedy.stop_node(waiting)
        greedy_watcher.wait(lambda s: waiting in s.dead and not s.pending, "the pending pod to go")
        assert greedy.node_states().disrupted == {}
    finally:
        greedy.close()
        provisioner.close()
        api.close()


def test_real_taken_name_is_skipped(kube_cluster: KubeCluster, kube: Kube, namespace: str) -> None:
    """A pod that already has the next name (the real server's 409 AlreadyExists) is skipped
    and left alone."""
    settings = sleeper_settings(namespace)
    leftover = pod_manifest(f"{settings.job_id}-worker-0", SLEEPER)
    kube.request("POST", POD, namespace, body=leftover)
    api = connect(kubeconfig=str(kube_cluster.kubeconfig))
    provisioner = KubernetesProvisioner(settings, api)
    try:
        assert provisioner.start_nodes(2) == [
            f"{settings.job_id}-worker-1",
            f"{settings.job_id}-worker-2",
        ]
    finally:
        provisioner.close()
        api.close()
    assert kube.get(POD, f"{settings.job_id}-worker-0", namespace) is not None  # not ours


def test_real_quota_refusal_is_said_once_and_the_pod_made_once_the_quota_allows(
    kube_cluster: KubeCluster, kube: Kube, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ResourceQuota's 403 holds up neither start_nodes nor the running pod: the node is
    pending, the refusal said once (naming the quota), and the pod made when the quota grows."""
    quota = {"metadata": {"name": "compute"}, "spec": {"hard": {"pods": "1"}}}
    kube.request("POST", QUOTA, namespace, body=quota)
    wait(
        lambda: ((kube.get(QUOTA, "compute", namespace) or {}).get("status") or {}).get("hard"),
        30.0,
        "the quota controller to count the namespace's pods",
    )
    api = connect(kubeconfig=str(kube_cluster.kubeconfig), rbac_advice=LAUNCHER_RBAC_ADVICE)
    sent = counting_creates(api)
    provisioner = KubernetesProvisioner(sleeper_settings(namespace, **FAST), api)
    try:
        watcher = Watcher(provisioner)
        with caplog.at_level(logging.INFO):
            first, second = provisioner.start_nodes(2)
            assert provisioner.node_states().pending >= {second}
            wait(lambda: sent.count(second) >= 4, 30.0, "4 refused creates")
            assert kube.get(POD, second, namespace) is None
            (said,) = warnings_with(caplog, "cannot create worker pods")
            assert f"refused to create pods in namespace '{namespace}'" in said
            assert "exceeded quota: compute" in said and "ResourceQuota is used up" in said
            kube.request(
                "PATCH",
                QUOTA,
                namespace,
                "compute",
                body={"spec": {"hard": {"pods": "2"}}},
                content_type="application/merge-patch+json",
            )
            watcher.wait(lambda s: not s.pending, "the pod to be created", 30)
            wait(
                lambda: any("allowed again" in r.getMessage() for r in caplog.records),
                10.0,
                "the end of the refusal to be said",
            )
        assert kube.get(POD, second, namespace) is not None
        assert len(warnings_with(caplog, "cannot create worker pods")) == 1
        assert provisioner.node_states().disrupted == {}
        assert first not in provisioner.node_states().dead
    finally:
        provisioner.close()
        api.close()


def test_real_rbac_refusal_is_said_once_and_the_pod_made_once_the_role_allows(
    kube_cluster: KubeCluster,
    kube: Kube,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """As a service account whose Role lacks ``create`` on pods: the node is pending, RBAC's
    refusal said once with the launcher's advice, and the pod made once the Role allows it."""
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    kube.request("POST", SERVICE_ACCOUNT, namespace, body={"metadata": {"name": "launcher"}})
    kube.request("POST", ROLE, namespace, body={"metadata": {"name": "launcher"}, "rules": rules})
    binding = {
        "metadata": {"name": "launcher"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "launcher"},
        "subjects": [{"kind": "ServiceAccount", "name": "launcher", "namespace": namespace}],
    }
    kube.request("POST", ROLE_BINDING, namespace, body=binding)
    token = kube_cluster.kubectl("create", "token", "launcher", "-n", namespace).stdout.strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": kube_cluster.server, "certificate-authority": str(kube_cluster.ca_cert)}}],
        "users": [{"name": "launcher", "user": {"token": token}}],
        "contexts": [{"name": "launcher", "context": {"cluster": "c", "user": "launcher"}}],
        "current-context": "launcher",
    }  # fmt: skip
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    api = connect(kubeconfig=str(tmp_path / "kubeconfig"), rbac_advice=LAUNCHER_RBAC_ADVICE)
    sent = counting_creates(api)
    provisioner = KubernetesProvisioner(sleeper_settings(namespace, **FAST), api)
    try:
        watcher = Watcher(provisioner)
        with caplog.at_level(logging.INFO):
            (name,) = provisioner.start_nodes(1)
            assert provisioner.node_states().pending == {name}
            wait(lambda: len(sent) >= 4, 30.0, "4 refused creates")
            assert kube.get(POD, name, namespace) is None
            (said,) = warnings_with(caplog, "cannot create worker pods")
            assert f"refused to create pods in namespace '{namespace}'" in said
            assert f'User "system:serviceaccount:{namespace}:launcher" cannot create' in said
            assert "The launcher's Role allows create on pods" in said and "k8s/" in said
            assert "The job goes on with the nodes it has" in said
            rules[0]["verbs"] += ["create", "delete"]
            kube.request(
                "PATCH",
                ROLE,
                namespace,
                "launcher",
                body={"rules": rules},
                content_type="application/merge-patch+json",
            )
            watcher.wait(lambda s: not s.pending and name not in s.dead, "the pod to be made", 30)
            wait(
                lambda: any("allowed again" in r.getMessage() for r in caplog.records),
                10.0,
                "the end of the refusal to be said",
            )
        assert kube.get(POD, name, namespace) is not None
        assert len(warnings_with(caplog, "cannot create worker pods")) == 1
    finally:
        provisioner.close()
        api.close()
