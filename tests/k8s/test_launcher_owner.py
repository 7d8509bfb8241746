"""The launcher finds the Job that runs its pod (the worker pods' owner), through the API."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from kubernetes import client

from launcher.k8s.mode import launcher_job
from tests.helpers.fake_kube import FakeKube, Fault


def launcher_pod(fake_kube: FakeKube, owners: list[dict[str, Any]]) -> str:
    """A launcher pod with these ownerReferences (the Job controller sets its own); its uid."""
    body = {
        "metadata": {"name": "job-launcher-x7k2p", "ownerReferences": owners},
        "spec": {"containers": [{"name": "launcher"}]},
    }
    with fake_kube.api_client() as api:
        return str(client.CoreV1Api(api).create_namespaced_pod("default", body).metadata.uid)


JOB_OWNER = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "name": "job-launcher",
    "uid": "uid-of-the-job",
    "controller": True,
    "blockOwnerDeletion": True,
}


def test_the_launcher_pods_job_is_read_from_its_owner_references_through_failures(
    fake_kube: FakeKube,
) -> None:
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}
    uid = launcher_pod(fake_kube, [other, JOB_OWNER])
    fake_kube.inject("get", "pods", Fault(500), Fault(drop=True), Fault(429, "TooManyRequests"))
    with fake_kube.kube() as kube:
        found = launcher_job(kube, "default", "job-launcher-x7k2p", uid, deadline=30)
    assert found == ("job-launcher", "uid-of-the-job")
    assert fake_kube.faults_left("get", "pods") == 0


@pytest.mark.parametrize("case", ["no job", "not a controller", "another pod", "forbidden"])
def test_without_its_job_the_launcher_owns_the_workers_itself_and_says_so(
    fake_kube: FakeKube, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    owners = {"no job": [], "not a controller": [{**JOB_OWNER, "controller": False}]}
    uid = launcher_pod(fake_kube, owners.get(case, [JOB_OWNER]))
    if case == "another pod":
        uid = "uid-of-a-pod-that-is-gone"
    if case == "forbidden":
        fake_kube.deny("get", "pods")
    with caplog.at_level(logging.WARNING), fake_kube.kube() as kube:
        assert launcher_job(kube, "default", "job-launcher-x7k2p", uid, deadline=5) is None
    [warning] = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "launcher.k8s.mode"
    ]
    assert "job-launcher-x7k2p" in warning
    expected = {
        "no job": "is not run by a Job",
        "not a controller": "is not run by a Job",
        "another pod": "is not in namespace 'default'",
        "forbidden": "needs get on pods",
    }
    assert expected[case] in warning, warning
