"""Every pod the manifests make satisfies the "restricted" Pod Security Standard, which the
namespace enforces (Pod Security Admission labels): the launcher's, etcd's, the worker template
and the worker pods the Kubernetes provisioner creates from it, for every overlay of k8s/ and
for `elastic-run k8s render` with several flag sets. Checked offline against the standard's
documented controls (tests/k8s/pod_security.py); real Pod Security admission judges the
overlays' pods and a privileged pod in tests/kube/test_cluster.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest

from launcher.k8s import manifests as m
from launcher.k8s import naming as n
from launcher.k8s.client import Kube
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from tests.k8s.pod_security import pod_spec_of, restricted_violations
from tests.k8s.test_manifests import (
    NAMESPACES,
    OVERLAY_SPECS,
    OVERLAYS,
    RENDER_SPECS,
    build,
    one,
    worker_template,
)

Obj = dict[str, Any]


def provisioned_worker(template: Obj, namespace: str, job_id: str, gpus: int | None) -> Obj:
    """The worker pod the launcher's provisioner creates from ``template``."""
    settings = KubernetesSettings(
        namespace=namespace,
        job_id=job_id,
        etcd="https://elastic-allreduce-etcd:2379",
        worker_template=template,
        launcher_pod_name=f"{job_id}-launcher-abcde",
        launcher_pod_uid="6b1c3c1e-0000-4000-8000-000000000000",
        gpus_per_node=gpus,
    )
    with Kube(kubernetes.client.ApiClient()) as kube:
        return KubernetesProvisioner(settings, kube).worker_pod(f"{job_id}-worker-0")


def pods_of(objects: tuple[Obj, ...] | list[Obj], namespace: str) -> dict[str, Obj]:
    """Every pod (or pod template) among ``objects``, by what it is."""
    pods = {o["kind"]: o for o in objects if o["kind"] in ("Job", "StatefulSet")}
    template = worker_template(objects)
    job_id = template["metadata"]["labels"][n.JOB_LABEL]
    gpus = template["spec"]["containers"][0]["resources"]["limits"].get(n.GPU_RESOURCE)
    pods["worker template"] = template
    pods["worker pod"] = provisioned_worker(template, namespace, job_id, gpus)
    return pods


def every_pod() -> dict[str, Obj]:
    found: dict[str, Obj] = {}
    for overlay in OVERLAYS:
        for what, pod in pods_of(build(overlay), NAMESPACES[overlay]).items():
            found[f"k8s/{overlay}: {what}"] = pod
    for name, spec in {**RENDER_SPECS, **OVERLAY_SPECS}.items():
        for what, pod in pods_of(m.render(spec), spec.namespace).items():
            found[f"render {name}: {what}"] = pod
    return found


EVERY_POD = every_pod()


def test_every_kind_of_pod_is_checked() -> None:
    kinds = {name.rsplit(": ", 1)[1] for name in EVERY_POD}
    assert kinds == {"Job", "StatefulSet", "worker template", "worker pod"}
    for overlay in OVERLAYS:
        assert f"k8s/{overlay}: StatefulSet" in EVERY_POD  # etcd, in every overlay


@pytest.mark.parametrize("name", list(EVERY_POD))
def test_every_pod_satisfies_the_restricted_pod_security_standard(name: str) -> None:
    assert restricted_violations(*pod_spec_of(EVERY_POD[name])) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_namespace_enforces_audits_and_warns_the_restricted_standard(overlay: str) -> None:
    namespace = one(build(overlay), "Namespace")
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted", mode
    # No pinned version: "latest", the standard of the cluster's own release.
    assert not [key for key in labels if key.endswith("-version")]
    assert n.POD_SECURITY_LABELS.items() <= labels.items()


#: One change per control of the standard, and the controls it breaks (their documented names).
BREAKS: dict[str, tuple[str | tuple[str, ...], Callable[[Obj], None]]] = {
    "privileged": (
        "Privileged Containers",
        lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True),
    ),
    "hostPath": (
        ("HostPath Volumes", "Volume Types"),  # the restricted volume types exclude it too
        lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    ),
    "hostNetwork": ("Host Namespaces", lambda p: p["spec"].update(hostNetwork=True)),
    "hostPID": ("Host Namespaces", lambda p: p["spec"].update(hostPID=True)),
    "hostIPC": ("Host Namespaces", lambda p: p["spec"].update(hostIPC=True)),
    "hostPort": (
        "Host Ports",
        lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
    ),
    "SYS_ADMIN": (
        "Capabilities",
        lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(
            add=["SYS_ADMIN"]
        ),
    ),
    "no drop ALL": (
        "Capabilities",
        lambda p: p["spec"]["containers"][0]["securityContext"].pop("capabilities"),
    ),
    "privilege escalation": (
        "Privilege Escalation",
        lambda p: p["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
    ),
    "no runAsNonRoot": (
        "Running as Non-root",
        lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"),
    ),
    "runAsUser 0": (
        "Running as Non-root user",
        lambda p: p["spec"]["containers"][0]["securityContext"].update(runAsUser=0),
    ),
    "no seccomp": ("Seccomp", lambda p: p["spec"]["securityContext"].pop("seccompProfile")),
    "Unconfined": (
        "Seccomp",
        lambda p: p["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    ),
    "nfs volume": (
        "Volume Types",
        lambda p: p["spec"]["volumes"].append({"name": "x", "nfs": {"server": "s", "path": "/"}}),
    ),
    "unsafe sysctl": (
        "Sysctls",
        lambda p: p["spec"]["securityContext"].update(
            sysctls=[{"name": "kernel.msgmax", "value": "1"}]
        ),
    ),
    "SELinux user": (
        "SELinux",
        lambda p: p["spec"]["securityContext"].update(seLinuxOptions={"user": "root"}),
    ),
    "procMount": (
        "/proc Mount Type",
        lambda p: p["spec"]["containers"][0]["securityContext"].update(procMount="Unmasked"),
    ),
    "AppArmor": (
        "AppArmor",
        lambda p: p["spec"]["securityContext"].update(appArmorProfile={"type": "Unconfined"}),
    ),
    "probe host": (
        "Host Probes / Lifecycle Hooks",
        lambda p: p["spec"]["containers"][0].update(
            livenessProbe={"httpGet": {"host": "10.0.0.1", "port": 80}}
        ),
    ),
    "hostProcess": (
        "HostProcess",
        lambda p: p["spec"]["securityContext"].update(windowsOptions={"hostProcess": True}),
    ),
}


@pytest.mark.parametrize("change", list(BREAKS))
def test_the_check_catches_a_pod_that_breaks_each_control(change: str) -> None:
    controls, apply = BREAKS[change]
    pod = copy.deepcopy(EVERY_POD["k8s/base: worker pod"])
    apply(pod)
    found = restricted_violations(*pod_spec_of(pod))
    expected = {controls} if isinstance(controls, str) else set(controls)
    assert {v.split(":")[0] for v in found} == expected, found
