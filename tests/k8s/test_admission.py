"""The cluster's admission policy for launchers (launcher/k8s/admission.py,
k8s/cluster/admission-policy.yaml): a job's launcher may create only its job's worker pods.

Checked against the policy's CEL expressions offline, with cel-python and the binding's
documented semantics (tests/k8s/admission_review.py), case by case. The real API server's
type-checking of the expressions and its admission chain, for some of these cases, are in
tests/kube/test_cluster.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest
import yaml

from launcher.k8s import admission
from launcher.k8s import manifests as m
from launcher.k8s import naming as n
from tests.conftest import ROOT
from tests.k8s.admission_review import PolicyReview, Request
from tests.k8s.test_manifests import (
    BASE_SPEC,
    NAMESPACES,
    OVERLAYS,
    RENDER_SPECS,
    VERSION,
    build,
    one,
    validate,
    worker_template,
)
from tests.k8s.test_pod_security import provisioned_worker

Obj = dict[str, Any]

CLUSTER_FILE = ROOT / "k8s" / "cluster" / "admission-policy.yaml"
REVIEW = PolicyReview(*admission.objects())
#: What each validation says when it denies (admission.VALIDATIONS, by name).
SAYS = {name: message for name, _, message in admission.VALIDATIONS}


class Job:
    """One job's objects as the cluster would hold them: its template ConfigMap (the policy's
    parameters), the worker pod its provisioner creates, and its launcher's user name."""

    def __init__(self, objects: tuple[Obj, ...] | list[Obj], namespace: str) -> None:
        self.namespace = namespace
        self.config_map = copy.deepcopy(one(objects, "ConfigMap"))
        self.config_map["metadata"]["namespace"] = namespace
        template = worker_template(objects)
        self.job_id = template["metadata"]["labels"][n.JOB_LABEL]
        gpus = template["spec"]["containers"][0]["resources"]["limits"].get(n.GPU_RESOURCE)
        self.worker = provisioned_worker(template, namespace, self.job_id, gpus)
        launcher = one(objects, "Job")["spec"]["template"]
        self.launcher_pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{self.job_id}-launcher-x1",
                "namespace": namespace,
                "labels": launcher["metadata"]["labels"],
                "annotations": launcher["metadata"].get("annotations", {}),
            },
            "spec": launcher["spec"],
        }
        account = launcher["spec"]["serviceAccountName"]
        self.launcher_user = n.service_account_user(namespace, account)

    def create(
        self, pod: Obj, *, user: str | None = None, params: list[Obj] | None = None
    ) -> list[str]:
        request = Request("CREATE", self.namespace, user or self.launcher_user)
        return REVIEW.review(
            request, obj=pod, candidates=[self.config_map] if params is None else params
        )

    def update(self, old: Obj, new: Obj) -> list[str]:
        request = Request("UPDATE", self.namespace, self.launcher_user)
        return REVIEW.review(request, obj=new, old=old, candidates=[self.config_map])

    def delete(self, pod: Obj) -> list[str]:
        request = Request("DELETE", self.namespace, self.launcher_user)
        return REVIEW.review(request, old=pod, candidates=[self.config_map])


def every_job() -> dict[str, Job]:
    jobs = {f"k8s/{o}": Job(build(o), NAMESPACES[o]) for o in OVERLAYS}
    for name, spec in RENDER_SPECS.items():
        jobs[f"render {name}"] = Job(m.render(spec), spec.namespace)
    return jobs


JOBS = every_job()
BASE = JOBS["k8s/base"]


# -- the objects -------------------------------------------------------------------------------


def test_the_cluster_file_is_what_render_prints_and_validates() -> None:
    objects = [doc for doc in yaml.safe_load_all(CLUSTER_FILE.read_text()) if doc]
    assert objects == admission.objects()
    rendered = m.render(replace(BASE_SPEC, with_admission_policy=True))
    assert [o for o in rendered if o["apiVersion"] == admission.API_VERSION] == objects
    for obj in objects:
        assert "namespace" not in obj["metadata"]  # cluster-scoped
        validate(obj)
    # admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy is GA since Kubernetes 1.30.
    assert tuple(int(part) for part in VERSION.split(".")[:2]) >= (1, 30)


def test_the_validation_would_catch_a_bad_policy() -> None:
    policy = admission.policy()
    policy["spec"]["validations"][0]["expresion"] = "true"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, VERSION, strict=True)


@pytest.mark.parametrize("name", list(JOBS))
def test_every_jobs_template_config_map_is_the_policys_parameter_for_its_launcher(
    name: str,
) -> None:
    job = JOBS[name]
    request = Request("CREATE", job.namespace, job.launcher_user)
    assert REVIEW.params_for(request, [job.config_map]) == [job.config_map]
    data = job.config_map["data"]
    assert data[n.SHAPE_JOB] == job.job_id
    assert data[n.SHAPE_LAUNCHER_ACCOUNT] == job.launcher_user.rsplit(":", 1)[1]
    assert data[n.SHAPE_WORKER_ACCOUNT] == job.worker["spec"]["serviceAccountName"]
    assert data[n.SHAPE_IMAGES].split(",") == [c["image"] for c in job.worker["spec"]["containers"]]
    # The shape's Secrets and claims are exactly those the worker pods mount.
    volumes = job.worker["spec"]["volumes"]
    secrets = [v["secret"]["secretName"] for v in volumes if "secret" in v]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    ]
    assert data[n.SHAPE_SECRETS] == ",".join(secrets)
    assert data[n.SHAPE_CLAIMS] == ",".join(claims)


# -- what the launcher may do --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(JOBS))
def test_the_worker_pod_the_provisioner_creates_is_admitted(name: str) -> None:
    job = JOBS[name]
    assert job.create(job.worker) == []


def test_the_launcher_may_annotate_its_own_pod_and_delete_its_workers() -> None:
    annotated = copy.deepcopy(BASE.launcher_pod)
    annotated["metadata"]["annotations"][n.RING_ANNOTATION] = "epoch 3: 2 ranks"
    assert BASE.update(BASE.launcher_pod, annotated) == []
    assert BASE.delete(BASE.worker) == []


def _container(pod: Obj) -> Obj:
    container: Obj = pod["spec"]["containers"][0]
    return container


#: Worker pods the launcher might be made to create, and the validations each must fail.
BAD_PODS: dict[str, tuple[set[str], Callable[[Obj], None]]] = {
    "privileged": (
        # (the API refuses privileged without privilege escalation as invalid)
        {"privileged", "non-root"},
        lambda p: _container(p)["securityContext"].update(
            privileged=True, allowPrivilegeEscalation=True
        ),
    ),
    "an added capability": (
        {"privileged"},
        lambda p: _container(p)["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
    ),
    "runAsUser 0": ({"non-root"}, lambda p: _container(p)["securityContext"].update(runAsUser=0)),
    "no runAsNonRoot": ({"non-root"}, lambda p: p["spec"]["securityContext"].pop("runAsNonRoot")),
    "privilege escalation": (
        {"non-root"},
        lambda p: _container(p)["securityContext"].update(allowPrivilegeEscalation=True),
    ),
    "a hostPath volume": (
        {"no-host-path", "volumes"},
        lambda p: p["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
    ),
    "another service account": (
        {"service-account"},
        lambda p: p["spec"].update(serviceAccountName="elastic-job-launcher"),
    ),
    "the default service account": (
        {"service-account"},
        lambda p: p["spec"].update(serviceAccountName="default"),
    ),
    "a service account token": (
        {"service-account"},
        lambda p: p["spec"].update(automountServiceAccountToken=True),
    ),
    "hostNetwork": ({"host-namespaces"}, lambda p: p["spec"].update(hostNetwork=True)),
    "hostPID": ({"host-namespaces"}, lambda p: p["spec"].update(hostPID=True)),
    "hostIPC": ({"host-namespaces"}, lambda p: p["spec"].update(hostIPC=True)),
    "another image": ({"images"}, lambda p: _container(p).update(image="attacker/miner:latest")),
    "an init container of another image": (
        {"images", "non-root"},  # (and without a securityContext)
        lambda p: p["spec"].update(
            initContainers=[{"name": "x", "image": "busybox", "command": ["sh"]}]
        ),
    ),
    "another job's label": (
        {"job-labels"},
        lambda p: p["metadata"]["labels"].update({n.JOB_LABEL: "other-job"}),
    ),
    "no worker role": (
        {"job-labels"},
        lambda p: p["metadata"]["labels"].update({n.ROLE_LABEL: n.ROLE_LAUNCHER}),
    ),
    "no labels": ({"job-labels"}, lambda p: p["metadata"].pop("labels")),
    "the etcd server's Secret": (
        {"volumes"},
        lambda p: p["spec"]["volumes"].append(
            {"name": "loot", "secret": {"secretName": n.ETCD_TLS_SECRET}}
        ),
    ),
    "another job's Secret": (
        {"volumes"},
        lambda p: p["spec"]["volumes"].append(
            {"name": "loot", "secret": {"secretName": "other-job-etcd-client"}}
        ),
    ),
    "a projected service account token": (
        {"volumes"},
        lambda p: p["spec"]["volumes"].append(
            {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
        ),
    ),
    "another claim": (
        {"volumes"},
        lambda p: p["spec"]["volumes"].append(
            {"name": "data", "persistentVolumeClaim": {"claimName": "someone-elses"}}
        ),
    ),
    "a variable from another Secret": (
        {"secret-variables"},
        lambda p: _container(p)["env"].append(
            {
                "name": "LOOT",
                "valueFrom": {"secretKeyRef": {"name": n.ETCD_TLS_SECRET, "key": "tls.key"}},
            }
        ),
    ),
    "variables from another Secret": (
        {"secret-variables"},
        lambda p: _container(p).update(envFrom=[{"secretRef": {"name": "db-password"}}]),
    ),
}


@pytest.mark.parametrize("change", list(BAD_PODS))
def test_the_launcher_may_not_create_a_pod_outside_its_worker_shape(change: str) -> None:
    failing, apply = BAD_PODS[change]
    pod = copy.deepcopy(BASE.worker)
    apply(pod)
    assert sorted(BASE.create(pod)) == sorted(SAYS[name] for name in failing)


def test_a_variable_from_the_jobs_own_secret_is_admitted() -> None:
    pod = copy.deepcopy(BASE.worker)
    secret = f"{BASE.job_id}-etcd-client"
    _container(pod)["env"].append(
        {"name": "P", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}
    )
    _container(pod)["envFrom"] = [{"secretRef": {"name": secret}}]
    assert BASE.create(pod) == []


def test_the_launcher_may_not_change_or_delete_other_pods() -> None:
    other_job = copy.deepcopy(BASE.worker)
    other_job["metadata"]["labels"][n.JOB_LABEL] = "other-job"
    etcd_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "elastic-allreduce-etcd-0", "labels": n.etcd_labels()},
        "spec": {"containers": [{"name": "etcd", "image": m.ETCD_IMAGE}]},
    }
    for pod in (other_job, etcd_pod):
        assert BASE.delete(pod) == [SAYS["own-pods"]]
        annotated = copy.deepcopy(pod)
        annotated["metadata"]["annotations"] = {"x": "y"}
        assert BASE.update(pod, annotated) == [SAYS["own-pods"]]


@pytest.mark.parametrize(
    "change",
    [
        lambda p: _container(p).update(image="attacker/miner:latest"),
        lambda p: p["metadata"]["labels"].update({n.JOB_LABEL: "other-job"}),
        lambda p: p["metadata"]["labels"].update({"app.kubernetes.io/name": "etcd"}),
    ],
    ids=["image", "job label", "another label"],
)
def test_the_launcher_may_not_change_the_images_or_labels_of_its_pods(
    change: Callable[[Obj], None],
) -> None:
    changed = copy.deepcopy(BASE.worker)
    change(changed)
    assert SAYS["unchanged"] in BASE.update(BASE.worker, changed)


# -- whom it applies to ---------------------------------------------------------------------------


def privileged_pod() -> Obj:
    pod = copy.deepcopy(BASE.worker)
    _container(pod)["securityContext"].update(privileged=True, allowPrivilegeEscalation=True)
    pod["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    return pod


@pytest.mark.parametrize(
    "user",
    [
        "system:serviceaccount:kube-system:job-controller",  # creates the launcher's pod
        "system:serviceaccount:elastic-allreduce:default",
        "system:serviceaccount:other-namespace:elastic-job-launcher",
        "alice@example.com",
    ],
)
def test_only_the_jobs_launcher_is_restricted_by_it(user: str) -> None:
    # Others are left to their RBAC and the namespace's Pod Security level (which refuses
    # this pod): the policy is about what the launcher's token can do.
    assert BASE.create(privileged_pod(), user=user) == []
    assert BASE.create(privileged_pod()) != []


def test_jobs_that_share_a_namespace_are_each_held_to_their_own_shape() -> None:
    spec_b = replace(
        BASE_SPEC, job=replace(BASE_SPEC.job, job_id="job-b"), image="registry.example.com/b:2"
    )
    job_b = Job(m.render(spec_b), BASE.namespace)
    both = [BASE.config_map, job_b.config_map]
    assert BASE.create(BASE.worker, params=both) == []
    assert job_b.create(job_b.worker, user=job_b.launcher_user, params=both) == []
    # Job B's launcher may not create job A's workers (A's labels, image, service account and
    # etcd client Secret).
    assert set(job_b.create(BASE.worker, user=job_b.launcher_user, params=both)) == {
        SAYS["job-labels"],
        SAYS["images"],
        SAYS["service-account"],
        SAYS["volumes"],
    }


def test_a_namespace_without_worker_shapes_is_not_affected() -> None:
    assert BASE.create(privileged_pod(), params=[]) == []
    unlabelled = copy.deepcopy(BASE.config_map)
    del unlabelled["metadata"]["labels"][n.WORKER_SHAPE_LABEL]
    assert BASE.create(privileged_pod(), params=[unlabelled]) == []


def test_other_resources_are_not_reviewed() -> None:
    request = Request("CREATE", BASE.namespace, BASE.launcher_user, resource="configmaps")
    assert REVIEW.review(request, obj={}, candidates=[BASE.config_map]) == []
