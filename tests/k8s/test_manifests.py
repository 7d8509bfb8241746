"""k8s/ renders with kustomize, every object validates against a current Kubernetes schema, and
the objects keep the contract between the launcher, its workers and the cluster (RBAC, worker
template, NetworkPolicy, etcd). ``elastic-run k8s render`` produces the same objects, and the
launcher Job's command line parses with ``elastic-run run`` back to the job's options."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from elastic_allreduce import env
from elastic_allreduce.store import EtcdSecurity
from launcher import job_options
from launcher.job_options import JobOptions
from launcher.k8s import manifests as m
from launcher.k8s import naming as n
from launcher.observe.events import default_events_file
from launcher.security.cli import security_from_args
from tests.conftest import ROOT

K8S = ROOT / "k8s"
OVERLAYS = ("base", "overlays/dev", "overlays/gpu-example")
NAMESPACES = {
    "base": "elastic-allreduce",
    "overlays/dev": "elastic-allreduce-dev",
    "overlays/gpu-example": "elastic-allreduce-gpu",
}
#: A current Kubernetes version among those kubernetes-validate ships schemas for.
VERSION = kubernetes_validate.latest_version()
CLUSTER_SCOPED = {
    "Namespace",
    "PriorityClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
CPU_COMMAND = ("python", "/opt/elastic-allreduce/examples/cnn_digits.py")

Obj = dict[str, Any]


def kubectl() -> str:
    """The system's kubectl, else the one `make setup` installs into the venv."""
    found = shutil.which("kubectl") or shutil.which(
        "kubectl", path=str(Path(sys.executable).parent)
    )
    assert found, "no kubectl on PATH or in the venv: run `make setup` (scripts/setup.sh)"
    return found


@functools.cache
def build(overlay: str) -> tuple[Obj, ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize k8s/{overlay} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def one(objects: tuple[Obj, ...] | list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


#: The keys of the worker template's ConfigMap: the template, and the job's worker shape.
TEMPLATE_DATA = {
    n.TEMPLATE_KEY,
    n.SHAPE_JOB,
    n.SHAPE_IMAGES,
    n.SHAPE_LAUNCHER_ACCOUNT,
    n.SHAPE_WORKER_ACCOUNT,
    n.SHAPE_SECRETS,
    n.SHAPE_CLAIMS,
}


def worker_template(objects: tuple[Obj, ...] | list[Obj]) -> Obj:
    config_map = one(objects, "ConfigMap")
    assert set(config_map["data"]) == TEMPLATE_DATA
    template = yaml.safe_load(config_map["data"][n.TEMPLATE_KEY])
    assert isinstance(template, dict)
    return template


def launcher_container(objects: tuple[Obj, ...] | list[Obj]) -> Obj:
    containers = one(objects, "Job")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["launcher"]
    return dict(containers[0])


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in the launcher's arguments (before ``--``)."""
    own = args[: args.index("--")]
    assert own.count(name) == 1, f"{name} given {own.count(name)} times in {own}"
    return own[own.index(name) + 1]


def validate(obj: Obj) -> None:
    try:
        kubernetes_validate.validate(obj, VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
        pytest.fail(f"{kind} {name} does not validate against Kubernetes {VERSION}: {exc}")


def test_the_overlays_tested_are_all_there_are() -> None:
    found = {str(path.parent.relative_to(K8S)) for path in K8S.rglob("kustomization.yaml")}
    assert found == set(OVERLAYS)


def test_the_schemas_are_of_a_current_kubernetes() -> None:
    major, minor = (int(part) for part in VERSION.split(".")[:2])
    assert (major, minor) >= (1, 33)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_every_overlay_validates(overlay: str) -> None:
    objects = build(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        [
            "Namespace",
            "PriorityClass",
            "PriorityClass",
            "Service",
            "Service",
            "StatefulSet",
            "PersistentVolumeClaim",
            "ServiceAccount",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ConfigMap",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            "Job",
        ]
    )
    for obj in objects:
        validate(obj)
    validate(worker_template(objects))


def test_the_validation_would_catch_a_bad_object() -> None:
    job = dict(one(build("base"), "Job"))
    job["spec"] = {**job["spec"], "backofLimit": 0}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_namespaced_object_is_in_the_overlays_namespace(overlay: str) -> None:
    objects = build(overlay)
    namespace = NAMESPACES[overlay]
    assert one(objects, "Namespace")["metadata"]["name"] == namespace
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"]
        else:
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    subjects = one(objects, "RoleBinding")["subjects"]
    assert [s["namespace"] for s in subjects] == [namespace]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launcher_has_exactly_the_least_privilege_it_needs(overlay: str) -> None:
    objects = build(overlay)
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = one(objects, "Role")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        ("", "pods", "create"),
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods", "delete"),
        ("", "pods", "patch"),  # the ring annotation on the launcher's own pod
        ("", "events", "create"),
    }
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    binding = one(objects, "RoleBinding")
    job_id = flag(launcher_container(objects)["args"], "--job-id")
    account = one(objects, "ServiceAccount", f"{job_id}-launcher")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    pod_spec = one(objects, "Job")["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == account["metadata"]["name"]
    # The workers run as a service account of their own that nothing grants any right, and
    # mount no token of it.
    workers = one(objects, "ServiceAccount", f"{job_id}-worker")
    assert workers["automountServiceAccountToken"] is False
    template = worker_template(objects)["spec"]
    assert template["serviceAccountName"] == workers["metadata"]["name"]
    assert template["automountServiceAccountToken"] is False
    assert [s["name"] for s in binding["subjects"]] == [account["metadata"]["name"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launcher_runs_elastic_run_in_kubernetes_mode(overlay: str) -> None:
    objects = build(overlay)
    container = launcher_container(objects)
    args = container["args"]
    assert container["command"] == ["elastic-run"]
    assert args[:2] == ["run", "--kubernetes"]
    assert flag(args, "--worker-template") == f"{n.TEMPLATE_DIR}/{n.TEMPLATE_KEY}"
    assert flag(args, "--namespace") == "$(ELASTIC_ALLREDUCE_NAMESPACE)"
    assert flag(args, "--etcd") == "https://elastic-allreduce-etcd:2379"
    low, start, high = (int(flag(args, f)) for f in ("--min-workers", "--workers", "--max-workers"))
    assert 1 <= low <= start <= high
    assert int(flag(args, "--nproc-per-node")) >= 1
    command = args[args.index("--") + 1 :]
    assert command[:2] == list(CPU_COMMAND)
    assert (ROOT / "examples" / "cnn_digits.py").is_file()
    env = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] if "valueFrom" in e else e["value"]
        for e in container["env"]
    }
    assert env == {
        "ELASTIC_ALLREDUCE_POD_NAME": "metadata.name",
        "ELASTIC_ALLREDUCE_POD_UID": "metadata.uid",
        "ELASTIC_ALLREDUCE_POD_IP": "status.podIP",
        "ELASTIC_ALLREDUCE_NAMESPACE": "metadata.namespace",
        # The launcher needs no GPU, whatever its image asks the NVIDIA runtime for.
        "NVIDIA_VISIBLE_DEVICES": "void",
    }
    job = one(objects, "Job")
    job_id = flag(args, "--job-id")
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"] == {
        n.NAME_LABEL: n.APP_NAME,
        n.JOB_LABEL: job_id,
        n.ROLE_LABEL: "launcher",
    }
    assert pod["spec"]["restartPolicy"] == "Never"
    config_map = one(objects, "ConfigMap")
    assert config_map["metadata"]["name"] == f"{job_id}-worker-template"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(mounts) == set(volumes) == {"worker-template", "tmp", "etcd-client"}
    assert mounts["worker-template"]["mountPath"] == n.TEMPLATE_DIR
    assert volumes["worker-template"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert_mounts_the_jobs_etcd_client_secret(mounts, volumes, job_id)
    # The launcher's TLS files and etcd user: the job's, in the mounted Secret.
    assert flag(args, "--etcd-user") == job_id
    for option, key in (
        ("--etcd-cacert", n.TLS_CA),
        ("--etcd-cert", n.TLS_CERT),
        ("--etcd-key", n.TLS_KEY),
        ("--etcd-password-file", n.PASSWORD_KEY),
    ):
        assert flag(args, option) == f"{n.ETCD_CLIENT_DIR}/{key}"


def assert_mounts_the_jobs_etcd_client_secret(
    mounts: dict[str, Obj], volumes: dict[str, Obj], job_id: str
) -> None:
    assert mounts["etcd-client"] == {
        "name": "etcd-client",
        "mountPath": n.ETCD_CLIENT_DIR,
        "readOnly": True,
    }
    assert volumes["etcd-client"]["secret"] == {"secretName": f"{job_id}-etcd-client"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_template_keeps_the_contract(overlay: str) -> None:
    objects = build(overlay)
    template = worker_template(objects)
    launcher = launcher_container(objects)
    job_id = flag(launcher["args"], "--job-id")
    assert template["kind"] == "Pod"
    assert template["metadata"]["labels"] == {
        n.NAME_LABEL: n.APP_NAME,
        n.JOB_LABEL: job_id,
        n.ROLE_LABEL: "worker",
    }
    spec = template["spec"]
    [container] = spec["containers"]
    assert container["name"] == "worker"
    # The GPU example's launcher runs the CPU image, its workers the GPU one.
    gpu_image = overlay == "overlays/gpu-example"
    assert container["image"] == launcher["image"] + ("-gpu" if gpu_image else "")
    assert container["command"] == ["elastic-run", "join"]
    # The worker's training command is its own, the launcher's (not config/job's from etcd).
    launcher_args = launcher["args"]
    assert container["args"] == launcher_args[launcher_args.index("--") :]
    assert {"name": "ELASTIC_ALLREDUCE_GLOO_IFACE", "value": "eth0"} in container["env"]
    # `elastic-run join` reads the job's etcd TLS files and user from these variables.
    variables = {e["name"]: e.get("value") for e in container["env"]}
    assert {name: variables.get(name) for name in env.ETCD_SECURITY} == {
        "ELASTIC_ALLREDUCE_ETCD_CACERT": f"{n.ETCD_CLIENT_DIR}/ca.crt",
        "ELASTIC_ALLREDUCE_ETCD_CERT": f"{n.ETCD_CLIENT_DIR}/tls.crt",
        "ELASTIC_ALLREDUCE_ETCD_KEY": f"{n.ETCD_CLIENT_DIR}/tls.key",
        "ELASTIC_ALLREDUCE_ETCD_USER": job_id,
        "ELASTIC_ALLREDUCE_ETCD_PASSWORD_FILE": f"{n.ETCD_CLIENT_DIR}/password",
        "ELASTIC_ALLREDUCE_ETCD_PASSWORD": None,
    }
    assert_mounts_the_jobs_etcd_client_secret(
        {m["name"]: m for m in container["volumeMounts"]},
        {v["name"]: v for v in spec["volumes"]},
        job_id,
    )
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert spec["restartPolicy"] == "Never"
    assert spec["terminationGracePeriodSeconds"] == m.WORKER_GRACE_SECONDS
    assert spec["priorityClassName"] == n.PRIORITY_CLASS
    one(objects, "PriorityClass", n.PRIORITY_CLASS)
    gpus = container["resources"]["limits"].get(n.GPU_RESOURCE)
    nproc = int(flag(launcher["args"], "--nproc-per-node"))
    if overlay == "overlays/gpu-example":
        assert gpus == 1
        assert nproc == 1
        assert {"key": n.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
    else:
        assert gpus is None


def test_the_priority_class_is_preemptible_and_never_preempts() -> None:
    priority = one(build("base"), "PriorityClass", n.PRIORITY_CLASS)
    # Below the default 0; not below the cluster autoscaler's expendable cut-off (-10).
    assert -10 <= priority["value"] < 0
    assert priority["preemptionPolicy"] == "Never"
    assert priority["globalDefault"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launcher_is_placed_before_its_workers_and_default_pods(overlay: str) -> None:
    objects = build(overlay)
    pod = one(objects, "Job")["spec"]["template"]["spec"]
    launcher = one(objects, "PriorityClass", pod["priorityClassName"])
    workers = one(objects, "PriorityClass", worker_template(objects)["spec"]["priorityClassName"])
    assert launcher["metadata"]["name"] == n.LAUNCHER_PRIORITY_CLASS
    # Above the workers' and the default (0), so a replacement launcher on a full cluster
    # preempts rather than waits; below the system classes and user classes' usual maximum.
    assert launcher["value"] > max(workers["value"], 0)
    assert launcher["value"] < 1_000_000
    assert launcher["preemptionPolicy"] == "PreemptLowerPriority"
    assert launcher["globalDefault"] is False


def failure_action(job: Obj, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """What the Job controller does with a failed pod of ``job`` whose launcher container
    exited with ``exit_code`` and whose status has these True conditions, as the pod failure
    policy is documented (kubernetes.io, "Pod failure policy"): the first rule that matches
    wins; onExitCodes matches the named container's exit code (In / NotIn); onPodConditions a
    condition of that type and status; no match counts towards backoffLimit ("Count")."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is not None:
            assert codes["containerName"] == "launcher"
            inside = exit_code in codes["values"]
            if exit_code != 0 and inside == (codes["operator"] == "In"):
                return str(rule["action"])
        for condition in rule.get("onPodConditions", []):
            if condition["type"] in conditions and condition.get("status", "True") == "True":
                return str(rule["action"])
    return "Count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launcher_job_restarts_its_pod_unless_the_job_itself_ended(overlay: str) -> None:
    from launcher import exit_codes  # noqa: PLC0415

    job = one(build(overlay), "Job")
    spec = job["spec"]
    # A failed launcher pod is replaced (the new one adopts the job), a few times only.
    assert 1 <= spec["backoffLimit"] <= 6
    assert spec["backoffLimit"] == m.LAUNCHER_BACKOFF_LIMIT
    # A pod failure policy needs restartPolicy Never, and replacements only after the pod
    # before ended (no two launchers side by side).
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    # A drain's or an eviction's SIGTERM hands over (exit code 5): a new pod, not counted.
    assert failure_action(job, exit_codes.EXIT_HANDED_OVER) == "Ignore"
    # The cluster disrupted the pod (eviction, preemption, node pressure), whatever the code.
    assert failure_action(job, 137, ("DisruptionTarget",)) == "Ignore"
    assert failure_action(job, exit_codes.EXIT_JOB_FAILED, ("DisruptionTarget",)) == "Ignore"
    # A crash, an OOM kill, etcd or the API out of reach: a new pod, counted.
    for crash in (137, 139, 143, exit_codes.EXIT_OPERATIONAL):
        assert failure_action(job, crash) == "Count", crash
    # The job ended as failed, or the launcher's input is wrong: another pod cannot help.
    assert failure_action(job, exit_codes.EXIT_JOB_FAILED) == "FailJob"
    assert failure_action(job, exit_codes.EXIT_BAD_INPUT) == "FailJob"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_admits_only_the_job_and_reaches_only_it_etcd_and_dns(
    overlay: str,
) -> None:
    objects = build(overlay)
    job_id = flag(launcher_container(objects)["args"], "--job-id")
    policies = {p["metadata"]["name"]: p["spec"] for p in objects if p["kind"] == "NetworkPolicy"}
    same_job = {"podSelector": {"matchLabels": {n.JOB_LABEL: job_id}}}
    pods = policies[job_id]
    assert pods["podSelector"] == same_job["podSelector"]
    assert pods["policyTypes"] == ["Ingress", "Egress"]
    assert pods["ingress"] == [{"from": [same_job]}]
    egress = pods["egress"]
    assert {"to": [same_job]} in egress
    etcd_pods = one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    [to_etcd] = [
        rule for rule in egress if rule.get("ports") == [{"protocol": "TCP", "port": 2379}]
    ]
    [peer] = to_etcd["to"]
    assert peer["podSelector"]["matchLabels"].items() <= etcd_pods.items()
    [dns] = [rule for rule in egress if "to" not in rule]
    assert sorted(p["port"] for p in dns["ports"]) == [53, 53]
    assert len(egress) == 3
    api = policies[f"{job_id}-launcher-api"]
    assert api["podSelector"]["matchLabels"] == {n.JOB_LABEL: job_id, n.ROLE_LABEL: "launcher"}
    assert api["policyTypes"] == ["Egress"]
    etcd = policies["elastic-allreduce-etcd"]
    assert etcd["podSelector"]["matchLabels"] == etcd_pods
    clients = etcd["ingress"][0]
    assert clients["from"] == [{"podSelector": {"matchLabels": {n.NAME_LABEL: n.APP_NAME}}}]
    assert clients["ports"] == [{"protocol": "TCP", "port": 2379}]
    # The workers and the launcher carry the label the etcd policy admits.
    assert worker_template(objects)["metadata"]["labels"][n.NAME_LABEL] == n.APP_NAME


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_the_launchers_metrics_port_and_only_it_is_opened(overlay: str) -> None:
    objects = build(overlay)
    args = launcher_container(objects)["args"]
    port = int(flag(args, "--metrics-port"))
    job = one(objects, "Job")
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert launcher_container(objects)["ports"] == [{"name": "metrics", "containerPort": port}]
    job_id = flag(args, "--job-id")
    policies = {p["metadata"]["name"]: p["spec"] for p in objects if p["kind"] == "NetworkPolicy"}
    scrape = policies[f"{job_id}-launcher-metrics"]
    assert scrape["podSelector"]["matchLabels"] == {n.JOB_LABEL: job_id, n.ROLE_LABEL: "launcher"}
    assert scrape["policyTypes"] == ["Ingress"]
    assert scrape["ingress"] == [{"ports": [{"protocol": "TCP", "port": port}]}]


def test_no_metrics_leaves_out_the_port_the_annotations_and_the_policy() -> None:
    objects = m.render(replace(BASE_SPEC, metrics_port=None))
    job = one(tuple(objects), "Job")
    assert "annotations" not in job["spec"]["template"]["metadata"]
    assert "--metrics-port" not in m.launcher_args(replace(BASE_SPEC, metrics_port=None))
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"]
    assert not [name for name in names if name.endswith("-launcher-metrics")]


def etcd_env(objects: tuple[Obj, ...]) -> dict[str, str]:
    [container] = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


@pytest.mark.parametrize(("overlay", "members"), [("base", 3), ("overlays/dev", 1)])
def test_etcd_has_the_members_its_initial_cluster_names(overlay: str, members: int) -> None:
    objects = build(overlay)
    statefulset = one(objects, "StatefulSet")
    spec = statefulset["spec"]
    assert spec["replicas"] == members
    assert spec["podManagementPolicy"] == "Parallel"
    peers = etcd_env(objects)["ETCD_INITIAL_CLUSTER"].split(",")
    assert [p.split("=")[0] for p in peers] == [
        f"elastic-allreduce-etcd-{i}" for i in range(members)
    ]
    peer_service = one(objects, "Service", spec["serviceName"])
    assert peer_service["spec"]["clusterIP"] == "None"
    assert peer_service["spec"]["publishNotReadyAddresses"] is True
    assert all(f"=https://elastic-allreduce-etcd-{i}." in p for i, p in enumerate(peers))
    assert all(f".{spec['serviceName']}.$(POD_NAMESPACE).svc:2380" in p for p in peers)
    client = one(objects, "Service", "elastic-allreduce-etcd")
    assert client["spec"]["ports"] == [{"name": "client", "port": 2379, "targetPort": "client"}]
    [container] = spec["template"]["spec"]["containers"]
    image, tag = container["image"].rsplit(":", 1)
    assert image == "gcr.io/etcd-development/etcd"
    assert tag.startswith("v3.5.")
    volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
    claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
    assert {m["name"] for m in container["volumeMounts"]} == {"data", "tls"}
    if overlay == "base":
        assert (claims, volumes) == ({"data"}, {"tls"})
    else:
        assert (claims, volumes) == (set(), {"data", "tls"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_speaks_only_tls_and_requires_client_certificates_from_its_secret(
    overlay: str,
) -> None:
    objects = build(overlay)
    settings = etcd_env(objects)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    for name in ("LISTEN_CLIENT_URLS", "ADVERTISE_CLIENT_URLS"):
        assert settings[f"ETCD_{name}"].startswith("https://"), name
    for name in ("LISTEN_PEER_URLS", "INITIAL_ADVERTISE_PEER_URLS"):
        assert settings[f"ETCD_{name}"].startswith("https://"), name
    for side in ("ETCD_", "ETCD_PEER_"):
        assert settings[f"{side}CLIENT_CERT_AUTH"] == "true"
        assert settings[f"{side}CERT_FILE"] == f"{n.ETCD_TLS_DIR}/tls.crt"
        assert settings[f"{side}KEY_FILE"] == f"{n.ETCD_TLS_DIR}/tls.key"
        assert settings[f"{side}TRUSTED_CA_FILE"] == f"{n.ETCD_TLS_DIR}/ca.crt"
    mount = {m["name"]: m for m in container["volumeMounts"]}["tls"]
    assert (mount["mountPath"], mount["readOnly"]) == (n.ETCD_TLS_DIR, True)
    secret = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]
    assert secret == {"secretName": "elastic-allreduce-etcd-tls"}
    # The probe needs no certificate: /health on the plain metrics port, which no Service
    # exposes and the NetworkPolicy does not open.
    assert settings["ETCD_LISTEN_METRICS_URLS"] == "http://0.0.0.0:2381"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 2381} in container["ports"]
    assert all(2381 not in {p["port"] for p in s["spec"]["ports"]} for s in services(objects))


def test_the_gpu_example_runs_the_cnn_on_2_to_8_workers_with_a_gpu_each() -> None:
    objects = build("overlays/gpu-example")
    args = launcher_container(objects)["args"]
    assert (flag(args, "--min-workers"), flag(args, "--max-workers")) == ("2", "8")
    # The launcher needs no GPU: the CPU image, and no GPU from the NVIDIA runtime either.
    assert launcher_container(objects)["image"] == "elastic-allreduce:0.1.0"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in launcher_container(objects)["env"]
    assert worker_template(objects)["spec"]["containers"][0]["image"] == (
        "elastic-allreduce:0.1.0-gpu"
    )
    # A cold GPU cluster (new nodes, a GPU image of several GB) needs minutes before any worker
    # is ready, and the start clock runs from the launcher's start (docs/gpu.md).
    assert float(flag(args, "--wait-timeout")) >= 900


def services(objects: tuple[Obj, ...]) -> list[Obj]:
    return [o for o in objects if o["kind"] == "Service"]


def normalized(objects: tuple[Obj, ...] | list[Obj]) -> dict[tuple[str, str], Obj]:
    """Objects by (kind, name), the worker template parsed; Namespace objects left out."""
    result: dict[tuple[str, str], Obj] = {}
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        copy = yaml.safe_load(yaml.safe_dump(obj))
        if copy["kind"] == "ConfigMap":
            copy["data"] = {k: yaml.safe_load(v) for k, v in copy["data"].items()}
        result[(copy["kind"], copy["metadata"]["name"])] = copy
    return result


#: Where k8s/ mounts the checkpoint claim in the worker pods.
CHECKPOINTS = "/checkpoints"
BASE_JOB = job_options.job_options(
    CPU_COMMAND,
    job_id=n.DEFAULT_JOB_ID,
    workers=2,
    min_workers=1,
    max_workers=4,
    checkpoint_dir=CHECKPOINTS,
)
BASE_SPEC = m.JobSpec(
    image="elastic-allreduce:0.1.0",
    job=BASE_JOB,
    with_etcd=True,
    with_priority_class=True,
    with_checkpoint_claim=True,
)
GPU_SPEC = m.JobSpec(
    image="elastic-allreduce:0.1.0-gpu",
    launcher_image="elastic-allreduce:0.1.0",
    job=job_options.job_options(
        (*CPU_COMMAND, "--epochs", "30"),
        job_id=n.DEFAULT_JOB_ID,
        workers=4,
        min_workers=2,
        max_workers=8,
        gpus_per_node=1,
        wait_timeout=900,
        checkpoint_dir=CHECKPOINTS,
    ),
    namespace="elastic-allreduce-gpu",
    cpu="4",
    memory="16Gi",
    with_etcd=True,
    with_priority_class=True,
    with_checkpoint_claim=True,
)
DEV_SPEC = m.JobSpec(
    image="elastic-allreduce:0.1.0",
    job=BASE_JOB,
    namespace="elastic-allreduce-dev",
    with_etcd=True,
    etcd_replicas=1,
    with_priority_class=True,
    with_checkpoint_claim=True,
)
#: The job each overlay runs, as `elastic-run k8s render` is told it.
OVERLAY_SPECS = {"base": BASE_SPEC, "overlays/dev": DEV_SPEC, "overlays/gpu-example": GPU_SPEC}


def test_the_base_is_what_render_prints_for_the_default_job() -> None:
    assert normalized(build("base")) == normalized(m.render(BASE_SPEC))


def test_the_gpu_example_is_what_render_prints_for_it() -> None:
    assert normalized(build("overlays/gpu-example")) == normalized(m.render(GPU_SPEC))


def test_the_dev_overlay_differs_from_render_only_in_its_etcd_and_claims_access_mode() -> None:
    built, rendered = normalized(build("overlays/dev")), normalized(m.render(DEV_SPEC))
    differing = {
        key for key in built.keys() | rendered.keys() if built.get(key) != rendered.get(key)
    }
    claim = ("PersistentVolumeClaim", n.CHECKPOINT_CLAIM)
    assert differing == {("StatefulSet", "elastic-allreduce-etcd"), claim}
    # A one-node cluster's default storage class offers ReadWriteOnce (all pods on that node).
    assert built[claim]["spec"].pop("accessModes") == ["ReadWriteOnce"]
    assert rendered[claim]["spec"].pop("accessModes") == ["ReadWriteMany"]
    assert built[claim] == rendered[claim]


RENDER_SPECS = {
    "defaults": m.JobSpec(
        image="registry.example.com/ea:1",
        job=job_options.job_options(("python", "train.py"), job_id=n.DEFAULT_JOB_ID),
    ),
    "gpus, selectors, tolerations, own etcd": m.JobSpec(
        image="registry.example.com/ea:1-gpu",
        job=job_options.job_options(
            ("python", "train.py", "--epochs", "3"),
            job_id="bert-7",
            workers=3,
            min_workers=2,
            max_workers=16,
            gpus_per_node=4,
            nproc_per_node=4,
            max_restarts=10,
            wait_timeout=300,
            checkpoint_dir="/checkpoints/bert-7",
        ),
        namespace="team-a",
        cpu="16",
        memory="64Gi",
        with_etcd=True,
        etcd_replicas=5,
        node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        tolerations=(m.Toleration("dedicated", value="ml"),),
        priority_class=None,
    ),
    "plain etcd of the namespace": m.JobSpec(
        image="ea:3",
        job=job_options.job_options(("python", "train.py"), job_id="plain-1"),
        with_etcd=True,
        etcd_replicas=1,
        etcd_tls=False,
    ),
    "external etcd over TLS": m.JobSpec(
        image="ea:4",
        job=job_options.job_options(("python", "train.py"), job_id="ext-tls"),
        etcd="https://etcd-0.infra:2379,https://etcd-1.infra:2379",
    ),
    "checkpoints, TensorBoard, admission policy, API server": m.JobSpec(
        image="registry.example.com/ea:5",
        job=job_options.job_options(
            ("python", "train.py"), job_id="tb-1", checkpoint_dir="/ckpt", keep_checkpoints=3
        ),
        namespace="team-b",
        checkpoint_claim="team-b-ckpt",
        with_checkpoint_claim=True,
        checkpoint_size="100Gi",
        checkpoint_storage_class="filestore-rwx",
        tensorboard_dir="/ckpt/tensorboard/tb-1",
        with_admission_policy=True,
        api_server_cidrs=("10.0.0.1/32", "fd00::1/128"),
    ),
    "launcher disruption budget, own launcher priority class": m.JobSpec(
        image="ea:6",
        job=job_options.job_options(("python", "train.py"), job_id="pdb-1"),
        launcher_priority_class="team-critical",
        launcher_disruption_budget=True,
    ),
    "no network policy, external etcd": m.JobSpec(
        image="ea:2",
        job=job_options.job_options(
            ("python", "-m", "mypkg.train"), job_id="ext-1", max_restarts=0, wait_timeout=12.5
        ),
        etcd="etcd-0.infra:2379,etcd-1.infra:2379",
        network_policy=False,
    ),
}


@pytest.mark.parametrize("name", RENDER_SPECS)
def test_render_output_validates(name: str) -> None:
    spec = RENDER_SPECS[name]
    text = m.to_yaml(m.render(spec))
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    for obj in objects:
        validate(obj)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == spec.namespace
    template = worker_template(objects)
    validate(template)
    [container] = template["spec"]["containers"]
    assert container["image"] == spec.image
    assert template["metadata"]["labels"][n.JOB_LABEL] == spec.job_id
    args = launcher_container(objects)["args"]
    assert flag(args, "--job-id") == spec.job_id
    assert flag(args, "--etcd") == spec.etcd_endpoints
    assert args[args.index("--") + 1 :] == list(spec.job.command)
    assert ("NetworkPolicy" in {o["kind"] for o in objects}) == spec.network_policy
    kinds = [o["kind"] for o in objects]
    assert kinds.count("PodDisruptionBudget") == int(spec.launcher_disruption_budget)
    launcher_pod = one(objects, "Job")["spec"]["template"]["spec"]
    assert launcher_pod.get("priorityClassName") == spec.launcher_priority_class
    # TLS and the job's client Secret exactly when the endpoints are https://.
    tls = name not in ("plain etcd of the namespace", "no network policy, external etcd")
    assert spec.etcd_endpoints.startswith("https://") == tls
    for pod in (template, one(objects, "Job")["spec"]["template"]):
        secrets = [v for v in pod["spec"]["volumes"] if "secret" in v]
        assert secrets == ([_client_secret(spec.job_id)] if tls else []), name
    assert ("--etcd-cacert" in args) == tls
    if spec.with_etcd:
        settings = {
            e["name"]: e.get("value")
            for e in one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert settings["ETCD_LISTEN_CLIENT_URLS"].startswith("https://" if tls else "http://")
        assert ("ETCD_CLIENT_CERT_AUTH" in settings) == tls
    if spec.job.gpus_per_node:
        assert container["resources"]["limits"][n.GPU_RESOURCE] == spec.job.gpus_per_node
        assert "priorityClassName" not in template["spec"]
        assert template["spec"]["nodeSelector"] == dict(spec.node_selector)
        assert len(template["spec"]["tolerations"]) == 2
        assert one(objects, "StatefulSet")["spec"]["replicas"] == 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_disruption_budget_holds_a_drain_of_the_launchers_node_by_default(overlay: str) -> None:
    # A drain's SIGTERM hands the job over (exit code 5) to the Job's next pod: a budget that
    # kept the launcher from eviction would stall the drain for as long as the job runs.
    assert not [o for o in build(overlay) if o["kind"] == "PodDisruptionBudget"]


def test_the_launcher_disruption_budget_covers_the_running_launcher_only() -> None:
    spec = RENDER_SPECS["launcher disruption budget, own launcher priority class"]
    objects = m.render(spec)
    budget = one(objects, "PodDisruptionBudget")
    launcher_labels = one(objects, "Job")["spec"]["template"]["metadata"]["labels"]
    selector = budget["spec"]["selector"]
    assert matches(selector, launcher_labels)
    assert not matches(selector, worker_template(objects)["metadata"]["labels"])
    # The only form the disruption controller computes for a Job's single pod (maxUnavailable
    # needs a controller with a scale); an unready launcher (starting, failing) is evictable.
    assert budget["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in budget["spec"]
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["metadata"]["labels"][n.JOB_LABEL] == spec.job_id


def _client_secret(job_id: str) -> Obj:
    return {"name": "etcd-client", "secret": {"secretName": f"{job_id}-etcd-client"}}


def parse_launcher_args(args: list[str], namespace: str) -> tuple[Any, JobOptions]:
    """The launcher's arguments parsed by `elastic-run run`'s own parser, and the job options
    it reads from them."""
    from launcher.cli import _build_parser  # noqa: PLC0415

    expanded = [a.replace("$(ELASTIC_ALLREDUCE_NAMESPACE)", namespace) for a in args]
    parsed = _build_parser().parse_args(expanded)
    return parsed, job_options.from_args(parsed)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_elastic_run_accepts_the_launchers_command_line(overlay: str) -> None:
    args = launcher_container(build(overlay))["args"]
    parsed, job = parse_launcher_args(args, NAMESPACES[overlay])
    assert parsed.command == "run"
    assert parsed.kubernetes is True
    assert parsed.worker_template == f"{n.TEMPLATE_DIR}/{n.TEMPLATE_KEY}"
    assert parsed.namespace == NAMESPACES[overlay]
    assert parsed.etcd == "https://elastic-allreduce-etcd:2379"
    assert parsed.job_id == "elastic-job"
    assert security_from_args(parsed) == EtcdSecurity(
        cacert=f"{n.ETCD_CLIENT_DIR}/ca.crt",
        cert=f"{n.ETCD_CLIENT_DIR}/tls.crt",
        key=f"{n.ETCD_CLIENT_DIR}/tls.key",
        user="elastic-job",
        password_file=f"{n.ETCD_CLIENT_DIR}/password",
    )
    assert parsed.min_workers <= parsed.workers <= parsed.max_workers
    assert parsed.command_args == args[args.index("--") :]
    # Every job option the overlay's job was rendered with reaches the launcher unchanged.
    assert job == OVERLAY_SPECS[overlay].job


@pytest.mark.parametrize("name", RENDER_SPECS)
def test_the_rendered_launcher_command_parses_back_to_the_same_job(name: str) -> None:
    spec = RENDER_SPECS[name]
    parsed, job = parse_launcher_args(m.launcher_args(spec), spec.namespace)
    assert job == spec.job
    assert parsed.etcd == spec.etcd_endpoints
    assert parsed.tensorboard_dir == spec.tensorboard_dir
    assert job_options.job_settings(job) == job_options.job_settings(spec.job)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_pods_made_from_the_template_validate(overlay: str) -> None:
    import kubernetes  # noqa: PLC0415

    from launcher.k8s.client import Kube  # noqa: PLC0415
    from launcher.k8s.provisioner import (  # noqa: PLC0415
        KubernetesProvisioner,
        KubernetesSettings,
    )

    objects = build(overlay)
    settings = KubernetesSettings(
        namespace=NAMESPACES[overlay],
        job_id="elastic-job",
        etcd="elastic-allreduce-etcd:2379",
        worker_template=worker_template(objects),
        launcher_pod_name="elastic-job-launcher-abcde",
        launcher_pod_uid="6b1c3c1e-0000-4000-8000-000000000000",
    )
    with Kube(kubernetes.client.ApiClient()) as kube:
        pod = KubernetesProvisioner(settings, kube).worker_pod("elastic-job-worker-0")
    validate(pod)
    assert pod["metadata"]["labels"] == worker_template(objects)["metadata"]["labels"]
    [container] = pod["spec"]["containers"]
    env = {e["name"] for e in container["env"]}
    assert {
        "ELASTIC_ALLREDUCE_GLOO_IFACE",
        "ELASTIC_ALLREDUCE_ETCD",
        "ELASTIC_ALLREDUCE_JOB_ID",
        "ELASTIC_ALLREDUCE_NODE_ID",
        "ELASTIC_ALLREDUCE_HOST",
    } <= env


# -- checkpoints, TensorBoard, grace period ------------------------------------------------------


def claim_mounts(pod_spec: Obj) -> dict[str, str]:
    """The pod's mount path of each PersistentVolumeClaim it mounts, by claim name."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod_spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    return {
        claims[mount["name"]]: mount["mountPath"]
        for container in pod_spec["containers"]
        for mount in container.get("volumeMounts", [])
        if mount["name"] in claims
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_workers_mount_the_checkpoint_claim_at_the_jobs_checkpoint_dir(overlay: str) -> None:
    objects = build(overlay)
    args = launcher_container(objects)["args"]
    assert flag(args, "--checkpoint-dir") == CHECKPOINTS
    claim = one(objects, "PersistentVolumeClaim")
    name = claim["metadata"]["name"]
    assert claim_mounts(worker_template(objects)["spec"]) == {name: CHECKPOINTS}
    # Writable for the images' group: the pods' fsGroup is the Dockerfiles' USER group.
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert f"USER {m.IMAGE_GROUP}:{m.IMAGE_GROUP}" in (ROOT / dockerfile).read_text()
    assert worker_template(objects)["spec"]["securityContext"]["fsGroup"] == m.IMAGE_GROUP
    # Shared by the namespace's jobs (each in its folder), kept when a job is deleted.
    assert n.JOB_LABEL not in claim["metadata"]["labels"]
    modes = claim["spec"]["accessModes"]
    assert modes == (["ReadWriteOnce"] if overlay == "overlays/dev" else ["ReadWriteMany"])
    # The launcher writes no checkpoint: it mounts the claim only for a TensorBoard folder.
    assert claim_mounts(one(objects, "Job")["spec"]["template"]["spec"]) == {}


def test_render_mounts_the_claim_only_with_a_checkpoint_dir() -> None:
    plain = RENDER_SPECS["defaults"]
    objects = m.render(plain)
    assert claim_mounts(worker_template(objects)["spec"]) == {}
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    spec = RENDER_SPECS["checkpoints, TensorBoard, admission policy, API server"]
    objects = m.render(spec)
    claim = one(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "team-b-ckpt"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "100Gi"}},
        "storageClassName": "filestore-rwx",
    }
    assert claim_mounts(worker_template(objects)["spec"]) == {"team-b-ckpt": "/ckpt"}


def test_the_tensorboard_dir_is_on_the_claim_that_the_launcher_and_the_workers_mount() -> None:
    spec = RENDER_SPECS["checkpoints, TensorBoard, admission policy, API server"]
    objects = m.render(spec)
    args = launcher_container(objects)["args"]
    tensorboard = flag(args, "--tensorboard-dir")
    assert tensorboard == "/ckpt/tensorboard/tb-1"
    launcher_mounts = claim_mounts(one(objects, "Job")["spec"]["template"]["spec"])
    worker_mounts = claim_mounts(worker_template(objects)["spec"])
    assert launcher_mounts == worker_mounts == {"team-b-ckpt": "/ckpt"}
    assert tensorboard.startswith("/ckpt/")
    # Not the job's own checkpoint folder.
    assert not tensorboard.startswith(f"/ckpt/{spec.job_id}/")


def test_the_worker_grace_period_outlasts_the_agents_graceful_leave() -> None:
    from launcher.vocabulary import NodeTemplate  # noqa: PLC0415

    [leave] = [f.default for f in fields(NodeTemplate) if f.name == "leave_timeout"]
    assert isinstance(leave, float)
    assert leave + 30 <= m.WORKER_GRACE_SECONDS
    for overlay in OVERLAYS:
        spec = worker_template(build(overlay))["spec"]
        assert spec["terminationGracePeriodSeconds"] == m.WORKER_GRACE_SECONDS


# -- read-only root filesystems, egress ----------------------------------------------------------


def writable_paths(pod_spec: Obj, container: Obj) -> set[str]:
    """The container's writable mounts (volumes that are not read-only by kind or mount)."""
    read_only_kinds = ("secret", "configMap", "downwardAPI", "projected")
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return {
        mount["mountPath"]
        for mount in container.get("volumeMounts", [])
        if not mount.get("readOnly")
        and not any(kind in volumes.get(mount["name"], {}) for kind in read_only_kinds)
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launcher_and_etcd_run_on_read_only_root_filesystems(overlay: str) -> None:
    objects = build(overlay)
    pod = one(objects, "Job")["spec"]["template"]["spec"]
    [launcher] = pod["containers"]
    assert launcher["securityContext"]["readOnlyRootFilesystem"] is True
    # The launcher writes its events file under the temp folder (/tmp: the images set no
    # TMPDIR), and nothing else without --tensorboard-dir: /tmp is its only writable mount.
    assert writable_paths(pod, launcher) == {"/tmp"}
    tmp = {v["name"]: v for v in pod["volumes"]}["tmp"]
    assert tmp == {"name": "tmp", "emptyDir": {"sizeLimit": m.LAUNCHER_TMP_LIMIT}}
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert "TMPDIR" not in (ROOT / dockerfile).read_text()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TMPDIR", raising=False)
        patch.setattr(tempfile, "tempdir", None)
        assert str(default_events_file("elastic-job")).startswith(tempfile.gettempdir() + "/")
    # etcd writes only its data directory, on its volume.
    etcd = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    [server] = etcd["containers"]
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    data_dir = etcd_env(objects)["ETCD_DATA_DIR"]
    assert [p for p in writable_paths(etcd, server) if data_dir.startswith(p + "/")]
    # The workers run the user's training script, which may write anywhere: not read-only.
    [worker] = worker_template(objects)["spec"]["containers"]
    assert "readOnlyRootFilesystem" not in worker["securityContext"]


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def egress_of(objects: tuple[Obj, ...] | list[Obj], labels: dict[str, str]) -> list[Obj]:
    """Every egress rule that applies to a pod with ``labels``; each NetworkPolicy that selects
    it must limit its egress (else it would be open)."""
    policies = [
        p["spec"]
        for p in objects
        if p["kind"] == "NetworkPolicy" and matches(p["spec"]["podSelector"], labels)
    ]
    assert any("Egress" in p["policyTypes"] for p in policies), "egress not limited"
    return [rule for p in policies if "Egress" in p["policyTypes"] for rule in p["egress"]]


@pytest.mark.parametrize(
    ("objects", "api_server"),
    [
        *((pytest.param(build(o), None, id=o)) for o in OVERLAYS),
        pytest.param(
            m.render(RENDER_SPECS["checkpoints, TensorBoard, admission policy, API server"]),
            ["10.0.0.1/32", "fd00::1/128"],
            id="render --api-server-cidr",
        ),
    ],
)
def test_the_launcher_reaches_only_its_job_etcd_dns_and_the_api_server(
    objects: tuple[Obj, ...] | list[Obj], api_server: list[str] | None
) -> None:
    job = one(objects, "Job")
    labels = job["spec"]["template"]["metadata"]["labels"]
    job_id = labels[n.JOB_LABEL]
    etcd = {"podSelector": {"matchLabels": n.etcd_labels()}}
    tcp = [{"protocol": "TCP", "port": port} for port in (443, 6443)]
    expected = [
        # Its own job's pods: the workers' notification services (ring changes).
        {"to": [{"podSelector": {"matchLabels": {n.JOB_LABEL: job_id}}}]},
        {"to": [etcd], "ports": [{"protocol": "TCP", "port": n.ETCD_CLIENT_PORT}]},
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {"ports": tcp}
        if api_server is None
        else {"to": [{"ipBlock": {"cidr": c}} for c in api_server], "ports": tcp},
    ]

    def canonical(rules: list[Obj]) -> list[str]:
        return sorted(json.dumps(rule, sort_keys=True) for rule in rules)

    assert canonical(egress_of(objects, labels)) == canonical(expected)
