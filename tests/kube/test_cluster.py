"""The private control plane itself, and the shipped manifests against a real API server.

- the cluster: ready, reachable from the root namespace only through the forwarder, the root
  namespace untouched, its certificates, a start failure quoting the component's log, and
  ``up`` → ``down`` leaving no process, namespace or mount;
- ``kubectl apply`` of the admission policy and of each overlay, accepted by the API server,
  its admission chain (Pod Security "restricted" judging the pods the controllers create) and
  the PersistentVolume binder;
- the launcher's Role: ``kubectl auth can-i`` and real calls with the launcher service
  account's token, through the launcher's own client (launcher.k8s);
- the cluster's admission policy for launchers, and Pod Security, refusing what they must.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.k8s.client import KINDS, Kind, Kube, connect
from launcher.k8s.errors import KubernetesApiError, KubernetesForbiddenError
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from tests.helpers import leftovers, testhosts
from tests.helpers.kube import cluster as kube
from tests.helpers.kube.cluster import KubeCluster, KubeClusterError
from tests.kube.conftest import cluster_unavailable

ROOT = kube.ROOT
ADMISSION_POLICY = ROOT / "k8s" / "cluster" / "admission-policy.yaml"
DEV = "elastic-allreduce-dev"
JOB = "elastic-job"
LAUNCHER_SA = "elastic-job-launcher"
#: What the launcher calls (launcher/k8s/): provisioner.py creates, gets, lists, watches and
#: deletes worker pods; mode.py gets its own pod; events.py creates Events and patches its pod.
LAUNCHER_RIGHTS: list[tuple[str, ...]] = [
    ("create", "pods"),
    ("get", "pods"),
    ("list", "pods"),
    ("watch", "pods"),
    ("delete", "pods"),
    ("patch", "pods"),
    ("create", "events"),
]
#: What it must not do in its namespace.
LAUNCHER_FORBIDDEN: list[tuple[str, ...]] = [
    ("get", "secrets"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("create", "pods", "exec"),  # (kubectl reads "pods/exec" as the pod named exec)
    ("create", "pods", "attach"),
    ("create", "pods", "portforward"),
    ("create", "pods", "eviction"),
    ("update", "pods", "status"),
    ("update", "configmaps"),
    ("create", "roles"),
    ("create", "rolebindings"),
    ("get", "jobs"),
    ("create", "deployments"),
]


def _wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def _get_json(cluster: KubeCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _objects(cluster: KubeCluster, target: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize`` renders for ``target``."""
    rendered = cluster.kubectl("kustomize", str(target)).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def _delete_namespace(cluster: KubeCluster, namespace: str) -> None:
    """Delete ``namespace`` without waiting: its pods' grace periods make the namespace
    controller take up to a minute, and each overlay has a namespace of its own."""
    cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


def _pods_created(cluster: KubeCluster, namespace: str, selectors: list[str]) -> None:
    """Wait until the controllers created a pod for each label selector (Pod Security admitted
    it); on a timeout, say what the namespace's events say."""
    deadline = time.monotonic() + 60
    missing = list(selectors)
    while missing and time.monotonic() < deadline:
        missing = [
            s for s in missing if not _get_json(cluster, "pods", "-n", namespace, "-l", s)["items"]
        ]
        if missing:
            time.sleep(0.25)
    if missing:
        events = cluster.kubectl("get", "events", "-n", namespace, check=False).stdout
        pytest.fail(f"no pod for {missing} in {namespace} after 60 s; events:\n{events}")


# -- the cluster -----------------------------------------------------------------------------


def test_api_server_ready_and_versioned(kube_cluster: KubeCluster) -> None:
    assert kube_cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    version = json.loads(kube_cluster.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == "v1.37.2"
    checks = kube_cluster.kubectl("get", "--raw", "/readyz?verbose").stdout
    for hook in ("etcd", "poststarthook/rbac/bootstrap-roles", "informer-sync"):
        assert f"[+]{hook} ok" in checks, checks
    state = json.loads(kube_cluster.state_file.read_text())
    contract = {
        "dir", "prefix", "bridge_namespace", "bridge", "cp_namespace", "subnet",
        "apiserver_address", "apiserver_port", "server", "kubeconfig", "in_cluster_kubeconfig",
        "ca_cert", "pids", "started",
    }  # fmt: skip
    assert contract <= set(state), contract - set(state)
    assert state["server"] == kube_cluster.server
    components = {"forward", "etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"}
    assert set(state["pids"]) == components | ({"kubelet"} if kube_cluster.nodes else set())


def test_root_namespace_untouched_and_in_cluster_kubeconfig(kube_cluster: KubeCluster) -> None:
    """Only the namespaces hold the cluster's links and addresses; from inside them the API is
    at 10.233.0.1:6443 (the in-cluster kubeconfig); from the root namespace only through the
    forwarder on 127.0.0.1."""
    root_links = testhosts._ip_json("addr", "show")
    root_addresses = [a["local"] for link in root_links for a in link.get("addr_info", [])]
    assert not any(a.startswith("10.233.") for a in root_addresses), root_addresses
    assert not {"br0", kube.CP_PORT} & {link["ifname"] for link in root_links}
    cp_ns = kube_cluster.cp_namespace
    cp_links = testhosts._ip_json("-n", cp_ns, "-4", "addr", "show", "dev", "eth0")
    assert [a["local"] for a in cp_links[0]["addr_info"]] == [kube.APISERVER_ADDRESS]
    bridge = testhosts._ip_json(
        "-n", kube_cluster.bridge_namespace, "link", "show", "master", "br0"
    )
    assert [link["ifname"] for link in bridge] == [kube.CP_PORT]
    inside = subprocess.run(
        ["ip", "netns", "exec", kube_cluster.cp_namespace, str(kube.KUBECTL),
         "--kubeconfig", str(kube_cluster.in_cluster_kubeconfig), "get", "--raw", "/readyz"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (inside.returncode, inside.stdout.strip()) == (0, "ok"), inside.stderr
    # The forwarder runs in the control plane's namespace, though it listens in the root one.
    forward_pid = kube_cluster.processes["forward"].pid
    assert forward_pid in testhosts.namespace_pids(kube_cluster.cp_namespace)


def test_serving_certificate_names(kube_cluster: KubeCluster) -> None:
    context = ssl.create_default_context(cafile=str(kube_cluster.ca_cert))
    port = int(kube_cluster.server.rsplit(":", 1)[1])
    with context.wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=10),
        server_hostname="kubernetes.default.svc",
    ) as tls:
        cert = tls.getpeercert()
    assert cert is not None
    names = {str(entry[1]) for entry in cert["subjectAltName"]}
    assert {
        "127.0.0.1", "10.233.0.1", "10.0.0.1", "localhost", "kubernetes", "kubernetes.default",
        "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
    } <= names  # fmt: skip
    whoami = json.loads(kube_cluster.kubectl("auth", "whoami", "-o", "json").stdout)
    assert "system:masters" in whoami["status"]["userInfo"]["groups"]


def test_refusals(
    kube_cluster: KubeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second cluster in a directory whose cluster runs, a missing binary, no root."""
    with pytest.raises(KubeClusterError, match="a cluster already runs in"):
        KubeCluster(kube_cluster.directory).start()
    assert kube_cluster.api_ready()  # untouched
    monkeypatch.setattr(kube, "BINARY", tmp_path / "missing")
    with pytest.raises(KubeClusterError, match="run `make kube-build`"):
        KubeCluster(tmp_path / "a").start()
    monkeypatch.undo()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(KubeClusterError, match="needs root"):
        KubeCluster(tmp_path / "b").start()


def test_start_failure_quotes_the_component_log(
    kube_cluster: KubeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API server that cannot start: one error with its log's end; nothing left behind."""
    monkeypatch.setattr(kube, "SERVICE_CIDR", "10.0.0.0/33")
    cluster = KubeCluster(tmp_path / "broken", timeout=60)
    with pytest.raises(KubeClusterError) as failure:
        cluster.start()
    message = str(failure.value)
    assert "kube-apiserver exited" in message, message
    assert "service-cluster-ip-range" in message, message
    assert not kube._namespaces_of(cluster.prefix)
    assert not [p for p in cluster.processes.values() if p.alive()]


def test_up_status_down_leave_nothing_behind(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    """The command line: ``up`` returns with the cluster running in the background, a second
    ``up`` refuses, ``down`` stops every process and removes every namespace and mount."""
    directory = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tests.helpers.kube.cluster", *args, "--dir", str(directory)],
            cwd=ROOT, capture_output=True, text=True, timeout=100, check=False,
        )  # fmt: skip

    try:
        up = cli("up", "--nodes", "0")
        assert up.returncode == 0, up.stderr
        assert "up in" in up.stdout
        state = json.loads((directory / "state.json").read_text())
        pids = state["pids"]
        assert all(testhosts.process_running(pid) for pid in pids.values())
        status = cli("status")
        assert status.returncode == 0 and "/readyz: ok" in status.stdout, status.stdout
        again = cli("up", "--nodes", "0")
        assert again.returncode == 1 and "already runs" in again.stderr, again.stderr
        down = cli("down")
        assert down.returncode == 0, down.stderr
        assert not [pid for pid in pids.values() if testhosts.process_running(pid)]
        prefix = state["prefix"]
        assert not [ns for ns in testhosts.all_namespaces() if ns.startswith(prefix)]
        assert not [p for p in Path("/run/netns").iterdir() if p.name.startswith(prefix)]
        assert not kube.mounts_under(directory)
        assert not (directory / "state.json").exists()
    finally:
        if (directory / "state.json").exists():
            cli("down")


# -- the manifests -----------------------------------------------------------------------------


def _apply(cluster: KubeCluster, target: Path) -> subprocess.CompletedProcess[str]:
    done = cluster.kubectl("apply", "-k", str(target), timeout=90)
    assert "would violate PodSecurity" not in done.stderr, done.stderr
    return done


def _versions(cluster: KubeCluster, target: Path) -> dict[str, str]:
    """The resourceVersion of every object rendered for ``target`` (each must exist)."""
    versions: dict[str, str] = {}
    for obj in _objects(cluster, target):
        meta = obj["metadata"]
        scope = ["-n", meta["namespace"]] if "namespace" in meta else []
        group = obj["apiVersion"].rpartition("/")[0]
        kind = f"{obj['kind']}.{group}" if group else obj["kind"]
        found = _get_json(cluster, kind, meta["name"], *scope)
        versions[f"{kind}/{meta['name']}"] = found["metadata"]["resourceVersion"]
    return versions


def _check_applied(cluster: KubeCluster, target: Path, namespace: str) -> None:
    """Every object rendered for ``target`` exists, and applying again changes none; the
    controllers made the launcher's and etcd's pods (which Pod Security "restricted"
    admitted); the checkpoint claim bound."""
    before = _versions(cluster, target)
    # kubectl says "configured" for some (it re-sends PriorityClass' globalDefault: false and
    # the StatefulSet's volumeClaimTemplates, which the server stores in another form), but
    # the server changes nothing: no resourceVersion moves.
    _apply(cluster, target)
    assert _versions(cluster, target) == before
    _pods_created(
        cluster,
        namespace,
        ["batch.kubernetes.io/job-name=elastic-job-launcher", "app.kubernetes.io/name=etcd"],
    )

    def bound() -> bool:
        claim = _get_json(cluster, "pvc", "elastic-allreduce-checkpoints", "-n", namespace)
        return bool(claim["status"].get("phase") == "Bound")

    _wait_for(bound, 30, f"the checkpoint claim in {namespace} to bind")


@pytest.fixture(scope="module")
def admission_policy(kube_cluster: KubeCluster) -> Iterator[None]:
    kube_cluster.kubectl("apply", "-f", str(ADMISSION_POLICY))
    yield
    kube_cluster.kubectl("delete", "-f", str(ADMISSION_POLICY), "--ignore-not-found")


@pytest.fixture(scope="module")
def dev_job(kube_cluster: KubeCluster, admission_policy: None) -> Iterator[str]:
    """k8s/overlays/dev applied (namespace elastic-allreduce-dev), deleted afterwards."""
    target = ROOT / "k8s" / "overlays" / "dev"
    try:
        _apply(kube_cluster, target)
        _check_applied(kube_cluster, target, DEV)
        _wait_for_policy(kube_cluster, DEV)
        yield DEV
    finally:
        _delete_namespace(kube_cluster, DEV)


def _wait_for_policy(cluster: KubeCluster, namespace: str) -> None:
    """Wait until the API server enforces the admission policy (it loads a new policy a moment
    after it was created): until a dry run of a pod with another image, as the launcher, is
    refused."""
    template_map = _get_json(cluster, "configmap", "elastic-job-worker-template", "-n", namespace)
    pod = yaml.safe_load(template_map["data"]["worker-pod.yaml"])
    pod["metadata"]["name"] = "elastic-job-policy-probe"
    pod["spec"]["containers"][0]["image"] = "busybox:1.36"
    user = f"system:serviceaccount:{namespace}:{LAUNCHER_SA}"

    def refused() -> bool:
        done = cluster.kubectl(
            *("create", "--dry-run=server", "-n", namespace, "--as", user, "-f", "-"),
            input=json.dumps(pod),
            check=False,
        )
        return done.returncode != 0 and "elastic-allreduce-launcher-pods" in done.stderr

    _wait_for(refused, 30, "the admission policy to be enforced")


def test_admission_policy_accepted(kube_cluster: KubeCluster, admission_policy: None) -> None:
    """The API server type-checks the policy's CEL against the Pod schema: no warnings."""
    policy = _get_json(kube_cluster, "validatingadmissionpolicy", "elastic-allreduce-launcher-pods")
    status = policy.get("status", {})
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    _get_json(kube_cluster, "validatingadmissionpolicybinding", "elastic-allreduce-launcher-pods")


def test_dev_overlay_accepted(dev_job: str) -> None:
    """Applied and checked by the fixture (every object, the pods, the bound claim)."""
    assert dev_job == DEV


@pytest.mark.parametrize(
    ("overlay", "namespace"),
    [("k8s/overlays/gpu-example", "elastic-allreduce-gpu"), ("k8s/base", "elastic-allreduce")],
)
def test_overlay_accepted(
    kube_cluster: KubeCluster, admission_policy: None, overlay: str, namespace: str
) -> None:
    try:
        _apply(kube_cluster, ROOT / overlay)
        _check_applied(kube_cluster, ROOT / overlay, namespace)
    finally:
        _delete_namespace(kube_cluster, namespace)


# -- RBAC --------------------------------------------------------------------------------------


def _can_i(
    cluster: KubeCluster, namespace: str, verb: str, resource: str, subresource: str = ""
) -> bool:
    user = f"system:serviceaccount:{DEV}:{LAUNCHER_SA}"
    args = ["auth", "can-i", verb, resource, "-n", namespace, "--as", user]
    done = cluster.kubectl(*args, f"--subresource={subresource}", check=False)
    assert done.stdout.strip() in {"yes", "no"}, done.stdout + done.stderr
    return done.stdout.strip() == "yes"


def test_launcher_rights_can_i(kube_cluster: KubeCluster, dev_job: str) -> None:
    allowed = {right: _can_i(kube_cluster, dev_job, *right) for right in LAUNCHER_RIGHTS}
    assert all(allowed.values()), allowed
    forbidden = {right: _can_i(kube_cluster, dev_job, *right) for right in LAUNCHER_FORBIDDEN}
    assert not any(forbidden.values()), forbidden
    elsewhere = {right: _can_i(kube_cluster, "default", *right) for right in LAUNCHER_RIGHTS}
    assert not any(elsewhere.values()), elsewhere


@pytest.fixture(scope="module")
def launcher_kube(
    kube_cluster: KubeCluster, dev_job: str, tmp_path_factory: pytest.TempPathFactory
) -> Kube:
    """The launcher's own API client, signed in with a token of its service account (the
    TokenRequest API, as the kubelet mounts it into the launcher's pod)."""
    token = kube_cluster.kubectl("create", "token", LAUNCHER_SA, "-n", dev_job, "--duration", "1h")
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": kube_cluster.server, "certificate-authority": str(kube_cluster.ca_cert)}}],
        "users": [{"name": "launcher", "user": {"token": token.stdout.strip()}}],
        "contexts": [{"name": "launcher", "context": {"cluster": "c", "user": "launcher",
                                                     "namespace": dev_job}}],
        "current-context": "launcher",
    }  # fmt: skip
    path = tmp_path_factory.mktemp("launcher") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    whoami = kube_cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=path).stdout
    user = json.loads(whoami)["status"]["userInfo"]["username"]
    assert user == f"system:serviceaccount:{dev_job}:{LAUNCHER_SA}"
    return connect(kubeconfig=str(path))


def _worker_pod(
    cluster: KubeCluster, kube_client: Kube, namespace: str, name: str
) -> dict[str, Any]:
    """The worker pod the launcher's provisioner makes from the shipped template, owned by the
    launcher's Job."""
    template_map = _get_json(cluster, "configmap", "elastic-job-worker-template", "-n", namespace)
    template = yaml.safe_load(template_map["data"]["worker-pod.yaml"])
    job = _get_json(cluster, "job", "elastic-job-launcher", "-n", namespace)
    settings = KubernetesSettings(
        namespace=namespace,
        job_id=JOB,
        etcd="https://elastic-allreduce-etcd:2379",
        worker_template=template,
        launcher_job_name=job["metadata"]["name"],
        launcher_job_uid=job["metadata"]["uid"],
    )
    return KubernetesProvisioner(settings, kube_client).worker_pod(name)


def test_launcher_real_calls(kube_cluster: KubeCluster, dev_job: str, launcher_kube: Kube) -> None:
    """What the launcher does, done with its token through its own client: allowed in its
    namespace; a pod in another namespace and reading Secrets are refused by RBAC."""
    pods = KINDS["Pod"]
    selector = "batch.kubernetes.io/job-name=elastic-job-launcher"
    (launcher_pod,) = launcher_kube.list(pods, dev_job, selector)
    own = launcher_kube.get(pods, launcher_pod["metadata"]["name"], dev_job)
    assert own is not None and own["metadata"]["ownerReferences"][0]["kind"] == "Job"
    pod = _worker_pod(kube_cluster, launcher_kube, dev_job, "elastic-job-worker-rbac")
    name = pod["metadata"]["name"]
    assert launcher_kube.create(pod)["metadata"]["uid"]
    _, version = launcher_kube.list_with_version(pods, dev_job, "elastic-allreduce/role=worker")
    annotation = {"metadata": {"annotations": {"elastic-allreduce/ring": "epoch 1: 1 ranks"}}}
    launcher_kube.patch(pods, name, dev_job, annotation)
    with launcher_kube.watch(pods, dev_job, "elastic-allreduce/role=worker", version, 1) as watch:
        changes = [event["type"] for event in watch]
    assert "MODIFIED" in changes, changes
    launcher_kube.create(
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{own['metadata']['name']}.rbac-test", "namespace": dev_job},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": own["metadata"]["name"],
                "namespace": dev_job,
            },
            "reason": "Joined",
            "message": "job elastic-job: a test event",
            "type": "Normal",
            "source": {"component": "elastic-run"},
        }
    )
    launcher_kube.delete(pods, name, dev_job)
    elsewhere = copy.deepcopy(pod)
    elsewhere["metadata"]["namespace"] = "default"
    with pytest.raises(KubernetesForbiddenError, match="forbidden"):
        launcher_kube.create(elsewhere)
    secrets = Kind("v1", "Secret", "secrets")
    with pytest.raises(KubernetesForbiddenError):
        launcher_kube.list(secrets, dev_job, "")
    with pytest.raises(KubernetesForbiddenError):
        launcher_kube.get(secrets, "elastic-job-etcd-client", dev_job)


# -- admission ---------------------------------------------------------------------------------


def _privileged(pod: dict[str, Any]) -> dict[str, Any]:
    privileged = copy.deepcopy(pod)
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    return privileged


def _pod_security(cluster: KubeCluster, namespace: str, level: str) -> None:
    label = f"pod-security.kubernetes.io/enforce={level}"
    cluster.kubectl("label", "namespace", namespace, label, "--overwrite")


def test_admission_policy_refuses_the_launchers_other_pods(
    kube_cluster: KubeCluster, dev_job: str, launcher_kube: Kube
) -> None:
    """As the launcher: another image is refused by the cluster's admission policy; so is a
    privileged pod where Pod Security does not enforce "restricted". An administrator is not
    held by the policy (the same pod with another image is admitted for them)."""
    pod = _worker_pod(kube_cluster, launcher_kube, dev_job, "elastic-job-worker-admission")
    other_image = copy.deepcopy(pod)
    other_image["spec"]["containers"][0]["image"] = "busybox:1.36"
    with pytest.raises(KubernetesApiError) as refused:
        launcher_kube.create(other_image)
    assert "elastic-allreduce-launcher-pods" in str(refused.value), refused.value
    admin = connect(kubeconfig=str(kube_cluster.kubeconfig))
    admin.create(other_image)
    admin.delete(KINDS["Pod"], other_image["metadata"]["name"], dev_job)
    _pod_security(kube_cluster, dev_job, "privileged")
    try:
        with pytest.raises(KubernetesApiError) as refused:
            launcher_kube.create(_privileged(pod))
        assert "elastic-allreduce-launcher-pods" in str(refused.value), refused.value
        assert "PodSecurity" not in str(refused.value)
    finally:
        _pod_security(kube_cluster, dev_job, "restricted")


def test_pod_security_restricted_refuses_a_privileged_pod(
    kube_cluster: KubeCluster, dev_job: str, launcher_kube: Kube
) -> None:
    """The namespace's "restricted" label refuses a privileged pod, even an admin's."""
    pod = _worker_pod(kube_cluster, launcher_kube, dev_job, "elastic-job-worker-privileged")
    admin = connect(kubeconfig=str(kube_cluster.kubeconfig))
    with pytest.raises(KubernetesApiError) as refused:
        admin.create(_privileged(pod))
    assert 'violates PodSecurity "restricted:latest"' in str(refused.value), refused.value
    assert "privileged" in str(refused.value)


# -- leftovers ---------------------------------------------------------------------------------


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_leftover_namespaces_found_and_stale_ones_removed() -> None:
    """The session-end check counts this process's cluster namespaces as its own; a cluster's
    namespaces whose creator is gone are stale when nothing runs in them, and kept (a cluster
    that `up` left running) when something does."""
    reason = cluster_unavailable()
    if reason is not None:
        pytest.skip(reason)
    ours = f"{kube.PREFIX}-{os.getpid()}-9999-br"
    dead = _dead_pid()
    empty, busy = f"{kube.PREFIX}-{dead}-1-br", f"{kube.PREFIX}-{dead}-2-cp"
    for name in (ours, empty, busy):
        testhosts._ip("netns", "add", name)
    runner = subprocess.Popen(["ip", "netns", "exec", busy, "sleep", "60"])
    try:
        testhosts._wait_until(lambda: bool(testhosts.namespace_pids(busy)), 10, "the process")
        assert ours in leftovers.session_namespaces(os.getpid())
        assert not {empty, busy} & set(leftovers.session_namespaces(os.getpid()))
        removed = kube.remove_stale()
        assert empty in removed and busy not in removed, removed
        assert busy in testhosts.all_namespaces()
    finally:
        runner.kill()
        runner.wait()
        assert leftovers.remove_namespaces([ours, empty, busy]) == []
    assert not {ours, empty, busy} & set(testhosts.all_namespaces())
