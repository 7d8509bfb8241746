"""The process kubelet (tests.helpers.kube.kubelet) against a real control plane, and its parts.

Without a cluster: the rules of pod_spec (``$(VAR)`` expansion, env resolution with the
downward API, Secrets and ConfigMaps, the command, volume files, the hosts file that stands in
for DNS), the pod address pool, and pod_init's mounts in a network namespace of its own (a mount
path that does not exist on the machine appears inside the pod only; a missing command is
reported as a StartError).

Against the real API server, scheduler and controller manager, with the kubelet's nodes (the
session's cluster when it has them, else this module's own): nodes Ready with their GPUs and
renewed Leases; a pod's own address, reaching another pod and the API server; env, downward
API, Secret/ConfigMap/emptyDir volumes and the service-account token where they belong, and the
mount paths absent from the machine; exit codes -> phase and containerStatuses; a bad spec
failing its pod only; a missing Secret keeping its pod waiting until it exists;
``kubectl delete`` -> SIGTERM seen by the process, then the pod and its sandbox gone; grace
expiry -> SIGKILL; an eviction; OnFailure restarts; a Job run to completion by the real Job
controller and a Deployment's pods available; Service and StatefulSet names resolving inside a
pod once their endpoints are ready; a claim's bound volume mounted; the kubelet's SIGTERM
removing everything it made. Each test's namespace, pods and sandboxes are gone before the next
test starts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from launcher.k8s.client import Kind, Kube, connect
from launcher.k8s.errors import KubernetesNotFoundError
from tests.helpers import testhosts
from tests.helpers.kube import pod_spec
from tests.helpers.kube.cluster import KubeCluster
from tests.helpers.kube.kubelet import (
    POD_INIT,
    AddressPool,
    KubeletClient,
)
from tests.helpers.kube.pod_spec import PodContext, PodSpecError
from tests.kube import conftest
from tests.kube.conftest import POD
from tests.kube.conftest import wait as _wait

Obj = dict[str, Any]

SECRET = Kind("v1", "Secret", "secrets")
CONFIG_MAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE = Kind("v1", "Service", "services")
JOB = Kind("batch/v1", "Job", "jobs")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
STATEFUL_SET = Kind("apps/v1", "StatefulSet", "statefulsets")
NODE = Kind("v1", "Node", "nodes", namespaced=False)
LEASE = Kind("coordination.k8s.io/v1", "Lease", "leases")
TOKEN_DIR = pod_spec.SERVICE_ACCOUNT_MOUNT
_numbers = itertools.count(1)


# -- without a cluster: pod_spec ---------------------------------------------------------------


class FakeSources:
    """Secrets and ConfigMaps from dicts; tokens made up (pod_spec's Sources)."""

    def __init__(
        self,
        secrets: Mapping[str, Mapping[str, bytes]] | None = None,
        config_maps: Mapping[str, Mapping[str, bytes]] | None = None,
    ) -> None:
        self.secrets = dict(secrets or {})
        self.config_maps = dict(config_maps or {})

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self.secrets.get(f"{namespace}/{name}")

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self.config_maps.get(f"{namespace}/{name}")

    def token(self, pod: Obj, audience: str | None, expiration: int) -> str:
        return f"token-for-{pod['metadata']['name']}-{audience}-{expiration}"


def _pod(**spec: Any) -> Obj:
    return {
        "metadata": {
            "name": "web-0",
            "namespace": "ml",
            "uid": "1234",
            "labels": {"app": "web", "tier": 'a"b'},
            "annotations": {"note": "x"},
        },
        "spec": {"nodeName": "node-1", "serviceAccountName": "trainer", **spec},
    }


def _ctx(pod: Obj, sources: FakeSources | None = None) -> PodContext:
    return PodContext(
        pod=pod,
        sources=sources or FakeSources(),
        pod_ip="10.233.1.7",
        host_ip="10.233.0.101",
        allocatable={"cpu": "4", "memory": "16Gi"},
        ca_cert=b"CA",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)-$(B)", "1-two"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$1"),
        ("cost $5 and $", "cost $5 and $"),
        ("$(A", "$(A"),
        ("$(A)$(A)", "11"),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, expected: str) -> None:
    assert pod_spec.expand(text, {"A": "1", "B": "two"}) == expected


def test_container_env_resolves_every_source_in_order() -> None:
    sources = FakeSources(
        secrets={"ml/creds": {"user": b"alice", "pass": b"s3cret"}},
        config_maps={"ml/settings": {"MODE": b"fast", "LEVEL": b"3", "1BAD": b"x"}},
    )
    container = {
        "name": "main",
        "resources": {"requests": {"cpu": "250m"}, "limits": {"memory": "2Gi"}},
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "env": [
            {"name": "GREETING", "value": "hi $(POD) $(CFG_MODE)"},  # POD not defined yet
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "LATER", "value": "$(POD)@$(NODE_IP)"},
            {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {"name": "USER", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "user"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "creds", "key": "no", "optional": True}},
            },
            {
                "name": "MILLICORES",
                "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}},
            },
            {
                "name": "MEM_MI",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
    }
    env = pod_spec.container_env(
        _ctx(_pod(containers=[container]), sources),
        container,
        base={"PATH": "/venv/bin", "HOSTNAME": "web-0"},
        services={"KUBERNETES_SERVICE_HOST": "10.233.0.1"},
    )
    assert env["GREETING"] == "hi $(POD) fast"
    assert env["LATER"] == "web-0@$(NODE_IP)"  # NODE_IP comes after it
    assert env["POD"] == "web-0"
    assert env["IP"] == "10.233.1.7"
    assert env["NODE_IP"] == "10.233.0.101"
    assert env["APP"] == "web"
    assert env["SA"] == "trainer"
    assert env["USER"] == "alice"
    assert "OPT" not in env
    assert env["CFG_MODE"] == "fast" and env["CFG_LEVEL"] == "3"
    assert "CFG_1BAD" in env and "1BAD" not in env  # the prefix makes the name valid
    assert env["MILLICORES"] == "250"
    assert env["MEM_MI"] == "2048"
    assert env["CPU_LIMIT"] == "4"  # no limit: the node's allocatable
    assert env["PATH"] == "/venv/bin"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.233.0.1"


def test_missing_references_wait_and_bad_fields_fail() -> None:
    ctx = _ctx(_pod())
    secret_env = {"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}
    with pytest.raises(PodSpecError) as waiting:
        pod_spec.container_env(ctx, {"env": [secret_env]}, base={}, services={})
    assert waiting.value.retry
    assert waiting.value.reason == "CreateContainerConfigError"
    assert "secret 'nope' not found" in waiting.value.message
    field_env = {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nope"}}}
    with pytest.raises(PodSpecError) as failing:
        pod_spec.container_env(ctx, {"env": [field_env]}, base={}, services={})
    assert not failing.value.retry
    assert "spec.nope" in failing.value.message


def test_command_and_args_follow_the_image_rules() -> None:
    ctx = _ctx(_pod())
    env = {"NAME": "x"}
    assert pod_spec.container_argv(
        ctx, {"command": ["echo", "$(NAME)"], "args": ["a", "$$(NAME)"]}, env
    ) == ["echo", "x", "a", "$(NAME)"]
    project = {"image": "registry.local:5000/team/elastic-allreduce:0.1.0"}
    assert pod_spec.container_argv(ctx, project, env) == ["elastic-run", "--help"]
    assert pod_spec.container_argv(ctx, {**project, "args": ["join"]}, env) == [
        "elastic-run",
        "join",
    ]
    with pytest.raises(PodSpecError, match="give the container a command") as error:
        pod_spec.container_argv(ctx, {"name": "c", "image": "busybox"}, env)
    assert not error.value.retry


def test_volume_files_honour_items_modes_and_optional() -> None:
    sources = FakeSources(
        secrets={"ml/tls": {"tls.crt": b"CERT", "tls.key": b"KEY"}},
        config_maps={"ml/conf": {"a.yaml": b"a: 1", "b.yaml": b"b: 2"}},
    )
    ctx = _ctx(_pod(), sources)
    files = pod_spec.volume_files(ctx, {"name": "t", "secret": {"secretName": "tls"}})
    assert {(f.path, f.data, f.mode) for f in files} == {
        ("tls.crt", b"CERT", 0o644),
        ("tls.key", b"KEY", 0o644),
    }
    files = pod_spec.volume_files(
        ctx,
        {
            "name": "c",
            "configMap": {
                "name": "conf",
                "defaultMode": 0o600,
                "items": [{"key": "b.yaml", "path": "sub/b.yaml", "mode": 0o640}],
            },
        },
    )
    assert [(f.path, f.data, f.mode) for f in files] == [("sub/b.yaml", b"b: 2", 0o640)]
    assert (
        pod_spec.volume_files(ctx, {"name": "o", "secret": {"secretName": "x", "optional": True}})
        == []
    )
    with pytest.raises(PodSpecError) as missing:
        pod_spec.volume_files(ctx, {"name": "m", "configMap": {"name": "absent"}})
    assert missing.value.retry
    escaping = {
        "name": "e",
        "configMap": {"name": "conf", "items": [{"key": "a.yaml", "path": "../x"}]},
    }
    with pytest.raises(PodSpecError, match="stay inside the volume"):
        pod_spec.volume_files(ctx, escaping)
    downward = pod_spec.volume_files(
        ctx,
        {
            "name": "d",
            "downwardAPI": {
                "items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
                ]
            },
        },
    )
    assert {f.path: f.data for f in downward} == {
        "labels": b'app="web"\ntier="a\\"b"\n',
        "name": b"web-0",
    }
    projected = pod_spec.volume_files(ctx, pod_spec.service_account_volume(ctx.pod))
    assert {f.path: f.data for f in projected} == {
        "token": b"token-for-web-0-None-3607",
        "ca.crt": b"CA",  # kube-root-ca.crt not published yet: the cluster's CA
        "namespace": b"ml",
    }


def test_service_names_map_each_service_to_one_ready_endpoint() -> None:
    services = [
        {"metadata": {"name": "web", "namespace": "ml"}, "spec": {"clusterIP": "10.0.0.9"}},
        {"metadata": {"name": "db", "namespace": "ml"}, "spec": {"clusterIP": "None"}},
        {"metadata": {"name": "web", "namespace": "other"}, "spec": {}},
        {"metadata": {"name": "idle", "namespace": "ml"}, "spec": {}},
    ]

    def endpoint_slice(namespace: str, service: str, *endpoints: Obj) -> Obj:
        return {
            "metadata": {
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "endpoints": list(endpoints),
        }

    slices = [
        endpoint_slice(
            "ml",
            "web",
            {"addresses": ["10.233.1.20"], "conditions": {"ready": False}},
            {"addresses": ["10.233.1.9"], "conditions": {"ready": True}},
        ),
        endpoint_slice(
            "ml", "db", {"addresses": ["10.233.1.30"], "hostname": "db-0", "conditions": {}}
        ),
        endpoint_slice("other", "web", {"addresses": ["10.233.1.40"]}),
        endpoint_slice(
            "ml", "idle", {"addresses": ["10.233.1.50"], "conditions": {"ready": False}}
        ),
    ]
    names = pod_spec.service_names("ml", services, slices)
    assert names["web"] == names["web.ml.svc.cluster.local"] == "10.233.1.9"
    assert names["web.other"] == names["web.other.svc"] == "10.233.1.40"
    assert names["db"] == names["db-0.db"] == names["db-0.db.ml.svc.cluster.local"] == "10.233.1.30"
    assert not any(name.startswith("idle") for name in names)
    hosts = pod_spec.hosts_file(_pod(hostname="web-0", subdomain="db"), "10.233.1.7", names)
    assert "10.233.1.7\tweb-0.db.ml.svc.cluster.local\tweb-0\n" in hosts
    line = next(line for line in hosts.splitlines() if line.startswith("10.233.1.9\t"))
    assert line.split("\t")[1].split() == [
        "web",
        "web.ml",
        "web.ml.svc",
        "web.ml.svc.cluster.local",
    ]


def test_address_pool_never_hands_out_an_address_in_use() -> None:
    pool = AddressPool(ipaddress.IPv4Network("10.233.0.0/22"))  # 10.233.1.1 .. 10.233.3.254
    taken = [pool.take() for _ in range(3 * 254)]
    assert len(set(taken)) == len(taken) == 762
    assert taken[0] == "10.233.1.1" and not any(a.endswith((".0", ".255")) for a in taken)
    with pytest.raises(Exception, match="no pod address is free"):
        pool.take()
    pool.release("10.233.2.7")
    assert pool.take() == "10.233.2.7"


# -- without a cluster: pod_init ---------------------------------------------------------------


def _run_pod_init(host: testhosts.Host, spec: Obj, folder: Path) -> tuple[int, str, str]:
    """Run pod_init in ``host``'s namespace as the kubelet does; (exit code, status, output)."""
    spec_file = folder / "init.json"
    spec_file.write_text(json.dumps(spec))
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            host.command(
                [sys.executable, "-I", str(POD_INIT), str(spec_file), "--status-fd", str(write_end)]
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write_end,),
            start_new_session=True,
        )
        os.close(write_end)
        write_end = -1
        output, _ = proc.communicate(timeout=30)
        with os.fdopen(read_end, "rb") as status:
            read_end = -1
            report = status.read().decode()
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    return proc.returncode, report, output.decode(errors="replace")


@pytest.fixture
def one_host() -> Iterator[testhosts.Host]:
    reason = testhosts.available()
    if reason is not None:
        pytest.skip(reason)
    with testhosts.TestHosts(1) as hosts:
        yield hosts[0]


def test_pod_init_mounts_missing_paths_inside_the_pod_only(
    one_host: testhosts.Host, tmp_path: Path
) -> None:
    tag = f"ea-kubelet-test-{os.getpid()}-{next(_numbers)}"
    conf, data, scratch = tmp_path / "conf", tmp_path / "data", tmp_path / "scratch"
    for folder in (conf, data, scratch):
        folder.mkdir()
    (conf / "setting").write_text("on")
    outside = [Path(f"/etc/{tag}"), Path(f"/{tag}")]
    program = textwrap.dedent(
        f"""
        import json, os, socket
        result = {{"hostname": socket.gethostname(), "cwd": os.getcwd()}}
        result["setting"] = open("/etc/{tag}/conf/setting").read()
        try:
            open("/etc/{tag}/conf/new", "w")
        except OSError as exc:
            result["readonly"] = exc.errno
        open("/{tag}/data/written", "w").write("by the pod")
        result["hosts"] = open("/etc/hosts").read()
        result["proc"] = os.path.exists("/proc/self/status")
        result["etc"] = os.path.exists("/etc/passwd")
        print(json.dumps(result))
        """
    )
    spec = {
        "argv": ["python3", "-c", program],
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin"},
        "cwd": f"/{tag}/work",
        "hostname": "unit-pod",
        "scratch": str(scratch),
        "tmpfs": [],
        "mounts": [
            {"source": str(conf), "target": f"/etc/{tag}/conf", "readonly": True},
            {"source": str(data), "target": f"/{tag}/data", "readonly": False},
        ],
    }
    code, report, output = _run_pod_init(one_host, spec, tmp_path)
    assert code == 0 and report == "", output
    result = json.loads(output.strip().splitlines()[-1])
    assert result["hostname"] == "unit-pod"
    assert result["cwd"] == f"/{tag}/work"
    assert result["setting"] == "on"
    assert result["readonly"] == 30  # EROFS
    assert one_host.ipv4 in result["hosts"]  # the namespace's own /etc/hosts
    assert result["proc"] and result["etc"]
    assert (data / "written").read_text() == "by the pod"
    assert not any(path.exists() for path in outside)
    assert socket.gethostname() != "unit-pod"
    assert not [m for m in _mount_points() if m.startswith(str(tmp_path))]


def test_pod_init_reports_a_command_that_does_not_exist(
    one_host: testhosts.Host, tmp_path: Path
) -> None:
    spec = {
        "argv": ["no-such-command-here", "x"],
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": "/",
        "hostname": "",
        "scratch": str(tmp_path),
        "mounts": [],
    }
    code, report, output = _run_pod_init(one_host, spec, tmp_path)
    assert code == 128
    status = json.loads(report)
    assert status["reason"] == "StartError"
    assert 'exec: "no-such-command-here": executable file not found in $PATH' in status["message"]
    assert "no-such-command-here" in output  # and in the container's log


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


# -- against the cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(kube_cluster: KubeCluster) -> KubeCluster:
    """The session's cluster, with the kubelet's nodes (tests/kube/conftest.py)."""
    assert conftest.NODES >= 2, "these tests need the session cluster's kubelet nodes"
    return kube_cluster


def watch_until(
    kube: Kube,
    kind: Kind,
    namespace: str | None,
    name: str,
    check: Callable[[Obj | None], bool],
    *,
    timeout: float,
    what: str,
) -> Obj | None:
    """The object (None once deleted) as soon as ``check`` holds for it: a list, then a watch
    from its resourceVersion, until ``timeout`` seconds pass (then the test fails)."""
    deadline = time.monotonic() + timeout
    last: Obj | None = None
    while True:
        items, version = kube.list_with_version(kind, namespace, "")
        last = next((i for i in items if i["metadata"]["name"] == name), None)
        if check(last):
            return last
        expired = False
        while not expired:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"timed out after {timeout} s waiting for {what}; last seen: {last}")
            with kube.watch(kind, namespace, "", version, max(1, int(remaining) + 1)) as watch:
                for event in watch:
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        expired = True  # 410 Gone: list again
                        break
                    version = obj["metadata"].get("resourceVersion", version)
                    if event["type"] == "BOOKMARK" or obj["metadata"].get("name") != name:
                        continue
                    last = None if event["type"] == "DELETED" else obj
                    if check(last):
                        return last
                    if time.monotonic() >= deadline:
                        break


def _phase(pod: Obj | None) -> str | None:
    return None if pod is None else (pod.get("status") or {}).get("phase")


def _container(pod: Obj) -> Obj:
    return pod["status"]["containerStatuses"][0]


def pod_manifest(name: str, script: str, **spec: Any) -> Obj:
    """A pod whose one container runs ``script`` with the checkout's Python."""
    container = {"name": "main", "image": "python:3.11", "command": ["python", "-u", "-c", script]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def create(kube: Kube, kind: Kind, namespace: str, manifest: Obj) -> Obj:
    return kube.request("POST", kind, namespace, body=manifest)


def running(kube: Kube, namespace: str, name: str, timeout: float = 30.0) -> Obj:
    pod = watch_until(
        kube,
        POD,
        namespace,
        name,
        lambda p: _phase(p) == "Running",
        timeout=timeout,
        what=f"{name} Running",
    )
    assert pod is not None
    return pod


def finished(kube: Kube, namespace: str, name: str, timeout: float = 30.0) -> Obj:
    pod = watch_until(
        kube,
        POD,
        namespace,
        name,
        lambda p: _phase(p) in {"Succeeded", "Failed"},
        timeout=timeout,
        what=f"{name} to finish",
    )
    assert pod is not None
    return pod


SLEEPER = textwrap.dedent(
    """
    import signal, sys, threading
    def on_term(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    threading.Event().wait()
    """
)


def test_nodes_are_ready_with_their_capacity_and_leases(cluster: KubeCluster, kube: Kube) -> None:
    nodes = {n["metadata"]["name"]: n for n in kube.list(NODE, None, "eakube/process-kubelet")}
    assert sorted(nodes) == [f"node-{i}" for i in range(1, cluster.nodes + 1)]
    for name, node in nodes.items():
        status = node["status"]
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", ready
        assert status["capacity"].get("nvidia.com/gpu") == (
            str(cluster.gpus_per_node) if cluster.gpus_per_node else None
        )
        assert status["allocatable"]["cpu"] == "4"
        assert {"type": "InternalIP", "address": status["addresses"][0]["address"]} in status[
            "addresses"
        ]
        lease = kube.get(LEASE, name, "kube-node-lease")
        assert lease is not None and lease["spec"]["holderIdentity"] == name
        # The TaintNodesByCondition admission plugin taints every new node not-ready; the node
        # lifecycle controller lifts the taint once it sees the node's Ready condition.
        watch_until(
            kube,
            NODE,
            None,
            name,
            lambda n: n is not None and not n["spec"].get("taints"),
            timeout=30.0,
            what=f"the node lifecycle controller to lift {name}'s not-ready taint",
        )
    lease = kube.get(LEASE, "node-1", "kube-node-lease")
    assert lease is not None
    first = lease["spec"]["renewTime"]
    _wait(
        lambda: (
            (kube.get(LEASE, "node-1", "kube-node-lease") or {}).get("spec", {}).get("renewTime")
            != first
        ),
        25.0,
        "the kubelet to renew node-1's Lease",
    )


def test_pods_get_their_own_addresses_and_reach_each_other_and_the_api(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    server = textwrap.dedent(
        """
        import socket
        listener = socket.create_server(("0.0.0.0", 8080))
        print("listening", flush=True)
        while True:
            conn, peer = listener.accept()
            conn.sendall(b"hello from the server to " + peer[0].encode())
            conn.close()
        """
    )
    started = time.monotonic()
    create(kube, POD, namespace, pod_manifest("server", server))
    pod = running(kube, namespace, "server")
    server_ip = pod["status"]["podIP"]
    print(f"\npod create -> Running: {time.monotonic() - started:.2f} s")
    kubelet.wait_for_log(namespace, "server", "listening")
    client = textwrap.dedent(
        f"""
        import json, os, socket
        own = os.environ["MY_IP"]
        peer = socket.create_connection(("{server_ip}", 8080), timeout=10).recv(200).decode()
        api = socket.create_connection(
            (os.environ["KUBERNETES_SERVICE_HOST"], int(os.environ["KUBERNETES_SERVICE_PORT"])),
            timeout=10,
        )
        print(json.dumps({{"peer": peer, "own": own, "api": api.getpeername()[0]}}))
        """
    )
    create(
        kube,
        POD,
        namespace,
        pod_manifest(
            "client",
            client,
            container={
                "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
            },
        ),
    )
    done = finished(kube, namespace, "client")
    output = kubelet.log(namespace, "client")
    assert _phase(done) == "Succeeded", output
    result = json.loads(output.strip().splitlines()[-1])
    client_ip = done["status"]["podIP"]
    assert result["own"] == client_ip != server_ip
    assert result["peer"] == f"hello from the server to {client_ip}"
    assert result["api"] == "10.233.0.1"
    for ip in (client_ip, server_ip):
        assert ip.startswith("10.233.") and not ip.startswith("10.233.0.")


def test_env_downward_api_and_volumes_land_where_they_belong(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    tag = f"ea-kubelet-{os.getpid()}-{next(_numbers)}"
    create(
        kube,
        SECRET,
        namespace,
        {"metadata": {"name": "creds"}, "stringData": {"user": "alice", "password": "s3cret"}},
    )
    create(
        kube,
        CONFIG_MAP,
        namespace,
        {"metadata": {"name": "settings"}, "data": {"mode": "fast", "job.yaml": "workers: 2"}},
    )
    program = textwrap.dedent(
        f"""
        import json, os, socket
        def read(path):
            with open(path) as source:
                return source.read()
        token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
        print(json.dumps({{
            "env": {{k: v for k, v in os.environ.items() if k.startswith("T_")}},
            "hostname": socket.gethostname(),
            "HOSTNAME": os.environ["HOSTNAME"],
            "secret": read("/etc/{tag}/creds/password"),
            "secret_mode": oct(os.stat("/etc/{tag}/creds/password").st_mode & 0o777),
            "config": read("/etc/{tag}/conf/renamed.yaml"),
            "config_files": sorted(os.listdir("/etc/{tag}/conf")),
            "labels": read("/{tag}/info/labels"),
            "scratch": os.access("/{tag}/scratch", os.W_OK),
            "token": len(read(token_dir + "/token")) > 100,
            "namespace": read(token_dir + "/namespace"),
            "ca": read(token_dir + "/ca.crt").startswith("-----BEGIN CERTIFICATE"),
            "cwd": os.getcwd(),
        }}), flush=True)
        """
    )
    manifest = pod_manifest(
        "envy",
        program,
        volumes=[
            {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
            {
                "name": "conf",
                "configMap": {
                    "name": "settings",
                    "items": [{"key": "job.yaml", "path": "renamed.yaml"}],
                },
            },
            {
                "name": "info",
                "downwardAPI": {
                    "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                },
            },
            {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        ],
        container={
            "workingDir": f"/{tag}/scratch",
            "env": [
                {"name": "T_PLAIN", "value": "a $(T_NAME) b"},
                {"name": "T_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "T_EXPANDED", "value": "$(T_NAME).$(T_NS)"},
                {"name": "T_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "T_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                {"name": "T_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "T_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {
                    "name": "T_APP",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}},
                },
                {"name": "T_USER", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "user"}}},
                {
                    "name": "T_MODE",
                    "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}},
                },
                {
                    "name": "T_OPTIONAL",
                    "valueFrom": {
                        "configMapKeyRef": {"name": "absent", "key": "x", "optional": True}
                    },
                },
            ],
            "envFrom": [{"secretRef": {"name": "creds"}, "prefix": "T_FROM_"}],
            "volumeMounts": [
                {"name": "creds", "mountPath": f"/etc/{tag}/creds"},
                {"name": "conf", "mountPath": f"/etc/{tag}/conf"},
                {"name": "info", "mountPath": f"/{tag}/info"},
                {"name": "scratch", "mountPath": f"/{tag}/scratch"},
            ],
        },
    )
    manifest["metadata"]["labels"]["team"] = "ml"
    create(kube, POD, namespace, manifest)
    pod = finished(kube, namespace, "envy")
    output = kubelet.log(namespace, "envy")
    assert _phase(pod) == "Succeeded", output
    result = json.loads(output.strip().splitlines()[-1])
    uid, node, ip = pod["metadata"]["uid"], pod["spec"]["nodeName"], pod["status"]["podIP"]
    assert result["env"] == {
        "T_PLAIN": "a $(T_NAME) b",
        "T_NAME": "envy",
        "T_EXPANDED": "envy.$(T_NS)",
        "T_NS": namespace,
        "T_UID": uid,
        "T_NODE": node,
        "T_IP": ip,
        "T_APP": "envy",
        "T_USER": "alice",
        "T_MODE": "fast",
        "T_FROM_user": "alice",
        "T_FROM_password": "s3cret",
    }
    assert result["hostname"] == result["HOSTNAME"] == "envy"
    assert (result["secret"], result["secret_mode"]) == ("s3cret", "0o400")
    assert result["config"] == "workers: 2" and result["config_files"] == ["renamed.yaml"]
    assert result["labels"] == 'app="envy"\nteam="ml"\n'
    assert result["scratch"] and result["cwd"] == f"/{tag}/scratch"
    assert result["token"] and result["ca"] and result["namespace"] == namespace
    # The mount paths existed inside the pod only.
    assert not Path(f"/etc/{tag}").exists() and not Path(f"/{tag}").exists()


def test_exit_codes_become_phases_and_container_statuses(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    create(kube, POD, namespace, pod_manifest("ok", "print('fine')"))
    create(kube, POD, namespace, pod_manifest("bad", "import sys; sys.exit(3)"))
    missing = pod_manifest("missing", "")
    missing["spec"]["containers"][0]["command"] = ["no-such-command-anywhere"]
    create(kube, POD, namespace, missing)
    unsupported = pod_manifest("nfs", "print('never')")
    unsupported["spec"]["volumes"] = [{"name": "v", "nfs": {"server": "10.9.9.9", "path": "/x"}}]
    unsupported["spec"]["containers"][0]["volumeMounts"] = [{"name": "v", "mountPath": "/v"}]
    create(kube, POD, namespace, unsupported)

    ok = finished(kube, namespace, "ok")
    assert _phase(ok) == "Succeeded"
    state = _container(ok)["state"]["terminated"]
    assert state["exitCode"] == 0 and state["reason"] == "Completed"
    assert state["startedAt"] and state["finishedAt"]
    assert _container(ok)["ready"] is False and _container(ok)["restartCount"] == 0
    ready = next(c for c in ok["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "PodCompleted"
    assert kubelet.log(namespace, "ok") == "fine\n"

    bad = finished(kube, namespace, "bad")
    assert _phase(bad) == "Failed"
    assert _container(bad)["state"]["terminated"]["exitCode"] == 3
    assert _container(bad)["state"]["terminated"]["reason"] == "Error"

    gone = finished(kube, namespace, "missing")
    assert _phase(gone) == "Failed"
    terminated = _container(gone)["state"]["terminated"]
    assert terminated["reason"] == "StartError" and terminated["exitCode"] == 128
    assert "no-such-command-anywhere" in terminated["message"]
    assert "executable file not found" in terminated["message"]

    nfs = finished(kube, namespace, "nfs")
    assert _phase(nfs) == "Failed"
    assert nfs["status"]["reason"] == "UnsupportedVolume"
    assert "nfs" in nfs["status"]["message"]
    # The kubelet carries on: a pod after the bad ones runs.
    create(kube, POD, namespace, pod_manifest("after", "print('still here')"))
    assert _phase(finished(kube, namespace, "after")) == "Succeeded"
    # A pod that ended keeps its status until deleted, without a sandbox.
    assert kube.get(POD, "ok", namespace) is not None
    assert kubelet.sandbox(namespace, "ok") is None


def test_a_missing_secret_keeps_the_pod_waiting_until_it_exists(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    manifest = pod_manifest(
        "patient",
        "import os; print('token', os.environ['TOKEN'], os.path.exists(" + repr(TOKEN_DIR) + "))",
        automountServiceAccountToken=False,
        container={
            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "t"}}}]
        },
    )
    create(kube, POD, namespace, manifest)
    waiting = watch_until(
        kube,
        POD,
        namespace,
        "patient",
        lambda p: bool(
            p
            and p.get("status", {}).get("containerStatuses")
            and "waiting" in _container(p)["state"]
            and _container(p)["state"]["waiting"].get("reason") == "CreateContainerConfigError"
        ),
        timeout=30.0,
        what="the pod to wait for its Secret",
    )
    assert waiting is not None and _phase(waiting) == "Pending"
    assert "secret 'later' not found" in _container(waiting)["state"]["waiting"]["message"]
    create(kube, SECRET, namespace, {"metadata": {"name": "later"}, "stringData": {"t": "abc"}})
    done = finished(kube, namespace, "patient")
    assert _phase(done) == "Succeeded"
    assert kubelet.log(namespace, "patient") == "token abc False\n"  # and no token mounted


def test_a_pod_deleted_before_its_container_started_ends_failed(kube: Kube, namespace: str) -> None:
    """It stays waiting for a Secret; deleted, it is reported Failed before the kubelet
    finishes the deletion, as a real kubelet does (a Job controller waits for that terminal
    phase before it lifts its job-tracking finalizer: without it the pod lingers)."""
    manifest = _holding(
        pod_manifest(
            "never",
            "print('ran')",
            automountServiceAccountToken=False,
            container={
                "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "no", "key": "t"}}}]
            },
        )
    )
    create(kube, POD, namespace, manifest)
    try:
        watch_until(
            kube,
            POD,
            namespace,
            "never",
            lambda p: bool(
                p
                and p.get("status", {}).get("containerStatuses")
                and "waiting" in _container(p)["state"]
            ),
            timeout=30.0,
            what="the pod to wait for its Secret",
        )
        kube.request("DELETE", POD, namespace, "never")
        ended = watch_until(
            kube,
            POD,
            namespace,
            "never",
            lambda p: bool(p and _phase(p) == "Failed"),
            timeout=30.0,
            what="the deleted pod to be reported Failed",
        )
        assert ended is not None
        assert _container(ended)["state"]["terminated"]["reason"] == "ContainerStatusUnknown"
    finally:
        _release(kube, namespace, "never")


def _holding(manifest: Obj) -> Obj:
    """The pod with a finalizer of the test's, so that it stays (terminated) after the kubelet
    finished its deletion: its last status can be read."""
    manifest["metadata"]["finalizers"] = ["example.com/test-hold"]
    return manifest


def _release(kube: Kube, namespace: str, name: str) -> None:
    with contextlib.suppress(KubernetesNotFoundError):
        kube.request(
            "PATCH",
            POD,
            namespace,
            name,
            body={"metadata": {"finalizers": None}},
            content_type="application/merge-patch+json",
        )


def test_delete_sends_sigterm_then_the_pod_is_gone(
    cluster: KubeCluster, kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    create(kube, POD, namespace, _holding(pod_manifest("term", SLEEPER)))
    try:
        running(kube, namespace, "term")
        kubelet.wait_for_log(namespace, "term", "ready")
        sandbox = kubelet.sandbox(namespace, "term")
        assert sandbox is not None and sandbox["netns"] in testhosts.all_namespaces()
        cluster.kubectl("delete", "pod", "term", "--namespace", namespace, "--wait=false")
        pod = watch_until(
            kube,
            POD,
            namespace,
            "term",
            lambda p: p is not None and "terminated" in _container(p)["state"],
            timeout=30.0,
            what="the kubelet to report the container terminated",
        )
        assert pod is not None
        assert kubelet.wait_for_log(namespace, "term", "got SIGTERM")
        # It stopped on SIGTERM: exit code 0, where the SIGKILL at the grace period's end
        # (30 s by default) would have made it 137.
        assert _phase(pod) == "Succeeded"
        assert _container(pod)["state"]["terminated"]["exitCode"] == 0
        _wait(
            lambda: sandbox["netns"] not in testhosts.all_namespaces(),
            10.0,
            "the pod's namespace to go",
        )
        assert not (testhosts.NETNS_ETC / sandbox["netns"]).exists()
    finally:
        _release(kube, namespace, "term")
    watch_until(
        kube, POD, namespace, "term", lambda p: p is None, timeout=30.0, what="term to be gone"
    )


def test_grace_period_expiry_kills_with_sigkill(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    stubborn = textwrap.dedent(
        """
        import signal, threading, time
        termed = threading.Event()
        def on_term(*_):
            print("ignoring SIGTERM", flush=True)
            termed.set()
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        termed.wait()
        since = time.monotonic()
        while True:  # how long it outlived SIGTERM, by its own clock
            print(f"alive {time.monotonic() - since:.1f} s after SIGTERM", flush=True)
            time.sleep(0.2)
        """
    )
    create(kube, POD, namespace, _holding(pod_manifest("stubborn", stubborn)))
    try:
        running(kube, namespace, "stubborn")
        kubelet.wait_for_log(namespace, "stubborn", "ready")
        kube.request(
            "DELETE",
            POD,
            namespace,
            "stubborn",
            body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 3},
        )
        pod = watch_until(
            kube,
            POD,
            namespace,
            "stubborn",
            lambda p: p is not None and "terminated" in _container(p)["state"],
            timeout=30.0,
            what="the kubelet to report the container killed",
        )
        assert pod is not None
        log = kubelet.log(namespace, "stubborn")
        assert "ignoring SIGTERM" in log
        terminated = _container(pod)["state"]["terminated"]
        assert terminated["exitCode"] == 137 and terminated.get("signal") == 9
        assert _phase(pod) == "Failed"
        # SIGTERM first, SIGKILL at the end of the requested 3 s, by the process's own clock:
        # past the kubelet's 2 s minimum grace period, which any shorter request would get.
        outlived = [float(x) for x in re.findall(r"alive (\d+\.\d) s after SIGTERM", log)]
        assert outlived and max(outlived) >= 2.2, log[-500:]
    finally:
        _release(kube, namespace, "stubborn")


def test_an_eviction_is_honoured(kube: Kube, kubelet: KubeletClient, namespace: str) -> None:
    create(kube, POD, namespace, pod_manifest("evictee", SLEEPER))
    running(kube, namespace, "evictee")
    kubelet.wait_for_log(namespace, "evictee", "ready")
    kube.request(
        "POST",
        POD,
        namespace,
        "evictee/eviction",
        body={
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": "evictee", "namespace": namespace},
        },
    )
    watch_until(
        kube,
        POD,
        namespace,
        "evictee",
        lambda p: p is None,
        timeout=30.0,
        what="the evicted pod to go",
    )
    assert "got SIGTERM" in kubelet.log(namespace, "evictee")


def test_on_failure_restarts_the_container_in_the_same_pod(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    flaky = textwrap.dedent(
        """
        import os, sys
        marker = "/work-area/failed-once"
        if os.path.exists(marker):
            print("second run", flush=True)
            sys.exit(0)
        open(marker, "w").close()
        print("first run", flush=True)
        sys.exit(1)
        """
    )
    manifest = pod_manifest(
        "flaky",
        flaky,
        restartPolicy="OnFailure",
        volumes=[{"name": "area", "emptyDir": {}}],
        container={"volumeMounts": [{"name": "area", "mountPath": "/work-area"}]},
    )
    create(kube, POD, namespace, manifest)
    pod = finished(kube, namespace, "flaky")
    assert _phase(pod) == "Succeeded"
    status = _container(pod)
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert status["state"]["terminated"]["exitCode"] == 0
    assert kubelet.log(namespace, "flaky") == "first run\nsecond run\n"


def test_a_job_runs_to_completion_and_a_deployment_becomes_available(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    template = pod_manifest("unused", "import os; print('done', os.environ['HOSTNAME'])")
    del template["metadata"]["name"]
    create(
        kube,
        JOB,
        namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "batch"},
            "spec": {"completions": 2, "parallelism": 2, "backoffLimit": 0, "template": template},
        },
    )
    deployment_template = pod_manifest("unused", SLEEPER)
    deployment_template["metadata"] = {"labels": {"app": "steady"}}
    deployment_template["spec"]["restartPolicy"] = "Always"
    create(
        kube,
        DEPLOYMENT,
        namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "steady"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "steady"}},
                "template": deployment_template,
            },
        },
    )
    job = watch_until(
        kube,
        JOB,
        namespace,
        "batch",
        lambda j: any(
            c["type"] in {"Complete", "Failed"} and c["status"] == "True"
            for c in ((j or {}).get("status") or {}).get("conditions") or []
        ),
        timeout=60.0,
        what="the Job to complete",
    )
    assert job is not None
    conditions = {c["type"]: c["status"] for c in job["status"]["conditions"]}
    assert conditions.get("Complete") == "True", job["status"]
    assert job["status"]["succeeded"] == 2
    deployment = watch_until(
        kube,
        DEPLOYMENT,
        namespace,
        "steady",
        lambda d: ((d or {}).get("status") or {}).get("availableReplicas") == 2,
        timeout=60.0,
        what="the Deployment's 2 replicas to be available",
    )
    assert deployment is not None
    pods = kube.list(POD, namespace, "app=steady")
    assert len({p["status"]["podIP"] for p in pods}) == 2
    assert {p["spec"]["nodeName"] for p in pods} <= {"node-1", "node-2"}


WEB_SERVER = textwrap.dedent(
    """
    import http.server, socket
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ("hello from " + socket.gethostname()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("0.0.0.0", 8080), Hello).serve_forever()
    """
)


def test_service_and_statefulset_names_resolve_inside_pods(
    kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    """The client starts first: the names appear in its hosts file (rewritten in place) once
    the Services have ready endpoints."""
    client = textwrap.dedent(
        f"""
        import json, socket, time, urllib.request
        try:
            socket.gethostbyname("web")
            print("web resolved before it existed", flush=True)
        except OSError:
            print("web unknown at first", flush=True)
        names = ["web", "web.{namespace}", "web.{namespace}.svc.cluster.local", "db-0.db",
                 "db-0.db.{namespace}.svc.cluster.local"]
        deadline = time.monotonic() + 60
        answers = {{}}
        for name in names:
            while True:
                try:
                    address = socket.gethostbyname(name)
                    text = urllib.request.urlopen(f"http://{{name}}:8080/", timeout=5).read()
                    answers[name] = [address, text.decode()]
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        answers[name] = ["unresolved", repr(exc)]
                        break
                    time.sleep(0.1)
        try:
            socket.gethostbyname("no-such-service")
            answers["no-such-service"] = "resolved"
        except OSError:
            answers["no-such-service"] = "unknown"
        print(json.dumps(answers))
        """
    )
    create(kube, POD, namespace, pod_manifest("client", client))
    running(kube, namespace, "client")
    kubelet.wait_for_log(namespace, "client", "web unknown at first")
    create(kube, POD, namespace, pod_manifest("web", WEB_SERVER, restartPolicy="Always"))
    create(
        kube,
        SERVICE,
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": 8080}]},
        },
    )
    create(
        kube,
        SERVICE,
        namespace,
        {
            "metadata": {"name": "db"},
            "spec": {"clusterIP": "None", "selector": {"app": "db"}, "ports": [{"port": 8080}]},
        },
    )
    db_template = pod_manifest("unused", WEB_SERVER)
    db_template["metadata"] = {"labels": {"app": "db"}}
    db_template["spec"]["restartPolicy"] = "Always"
    create(
        kube,
        STATEFUL_SET,
        namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "db"},
            "spec": {
                "serviceName": "db",
                "replicas": 1,
                "selector": {"matchLabels": {"app": "db"}},
                "template": db_template,
            },
        },
    )
    web_pod = running(kube, namespace, "web")
    db_pod = running(kube, namespace, "db-0", timeout=60.0)
    done = finished(kube, namespace, "client", timeout=90.0)
    output = kubelet.log(namespace, "client")
    assert _phase(done) == "Succeeded", output
    answers = json.loads(output.strip().splitlines()[-1])
    web_ip, db_ip = web_pod["status"]["podIP"], db_pod["status"]["podIP"]
    for name in ("web", f"web.{namespace}", f"web.{namespace}.svc.cluster.local"):
        assert answers[name] == [web_ip, "hello from web"], answers
    for name in ("db-0.db", f"db-0.db.{namespace}.svc.cluster.local"):
        assert answers[name] == [db_ip, "hello from db-0"], answers
    assert answers["no-such-service"] == "unknown"


def test_a_claim_mounts_its_bound_volume(
    cluster: KubeCluster, kube: Kube, kubelet: KubeletClient, namespace: str
) -> None:
    """The pod writes into the PersistentVolume (a hostPath folder of the cluster) its claim
    is bound to; afterwards the volume is recycled for the other tests."""
    claim_kind = Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
    volume_kind = Kind("v1", "PersistentVolume", "persistentvolumes", namespaced=False)
    create(
        kube,
        claim_kind,
        namespace,
        {
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    manifest = pod_manifest(
        "writer",
        "open('/data/proof', 'w').write('written in the pod')",
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        container={"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
    )
    create(kube, POD, namespace, manifest)
    volume_name = None
    try:
        pod = finished(kube, namespace, "writer", timeout=60.0)
        assert _phase(pod) == "Succeeded", kubelet.log(namespace, "writer")
        claim = kube.get(claim_kind, "data", namespace)
        assert claim is not None
        volume_name = claim["spec"]["volumeName"]
        volume = kube.get(volume_kind, volume_name, None)
        assert volume is not None
        folder = Path(volume["spec"]["hostPath"]["path"])
        assert (folder / "proof").read_text() == "written in the pod"
        assert not Path("/data/proof").exists()
    finally:
        kube.request("DELETE", POD, namespace, "writer")
        with contextlib.suppress(KubernetesNotFoundError):
            kube.request("DELETE", claim_kind, namespace, "data")
        if volume_name is not None:
            watch_until(
                kube,
                volume_kind,
                None,
                volume_name,
                lambda v: ((v or {}).get("status") or {}).get("phase") == "Released",
                timeout=30.0,
                what=f"{volume_name} to be released",
            )
            assert volume_name in cluster.recycle_volumes()


def test_a_kubelet_stop_removes_everything_it_made(tmp_path: Path) -> None:
    """A cluster of its own: stopping it (the kubelet first) leaves no pod namespace, no
    /etc/netns folder, no node and no process."""
    reason = conftest.cluster_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = KubeCluster(tmp_path / "stop", nodes=1)
    cluster.start()
    closed = False
    try:
        client = connect(kubeconfig=str(cluster.kubeconfig))
        kubelet = KubeletClient(cluster.state())
        try:
            create(client, POD, "default", pod_manifest("lingering", SLEEPER))
            running(client, "default", "lingering")
            kubelet.wait_for_log("default", "lingering", "ready")
            sandbox = kubelet.sandbox("default", "lingering")
            assert sandbox is not None
            pid = cluster.processes["kubelet"].pid
            cluster.processes["kubelet"].stop(60.0)
            assert not testhosts.process_running(pid)
            assert "got SIGTERM" in kubelet.log("default", "lingering")
            assert sandbox["netns"] not in testhosts.all_namespaces()
            assert not (testhosts.NETNS_ETC / sandbox["netns"]).exists()
            assert client.list(NODE, None, "") == []
        finally:
            client.close()
        cluster.close()
        closed = True
    finally:
        if not closed:
            cluster.close()
