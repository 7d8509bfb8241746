"""The fake Kubernetes API behaves like the real one, seen through the official client."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.helpers.fake_kube import SIGKILL_EXIT_CODE, FakeKube, Fault, quota_message


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


@pytest.fixture
def core(kube: FakeKube) -> Iterator[client.CoreV1Api]:
    with kube.api_client() as api:
        yield client.CoreV1Api(api)


def pod_body(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "busybox", **spec}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [container], "restartPolicy": "Never"},
    }


def test_create_fills_metadata_and_a_second_create_is_409_already_exists(
    core: client.CoreV1Api,
) -> None:
    created = core.create_namespaced_pod("default", pod_body("a"))
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert int(created.metadata.resource_version) > 0
    assert created.status.phase == "Pending"
    with pytest.raises(ApiException) as raised:
        core.create_namespaced_pod("default", pod_body("a"))
    assert raised.value.status == 409
    assert '"reason": "AlreadyExists"' in raised.value.body.replace(":", ": ").replace("  ", " ")


def test_missing_objects_and_namespaces_are_404(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as raised:
        core.read_namespaced_pod("nope", "default")
    assert raised.value.status == 404
    with pytest.raises(ApiException) as raised:
        core.delete_namespaced_pod("nope", "default")
    assert raised.value.status == 404
    with pytest.raises(ApiException) as raised:
        core.create_namespaced_pod("no-such-ns", pod_body("a"))
    assert raised.value.status == 404


def test_generate_name_and_label_selectors(core: client.CoreV1Api) -> None:
    body = pod_body("", {"job": "x", "role": "worker"})
    body["metadata"] = {"generateName": "w-", "labels": {"job": "x", "role": "worker"}}
    made = core.create_namespaced_pod("default", body)
    assert made.metadata.name.startswith("w-") and len(made.metadata.name) == 7
    core.create_namespaced_pod("default", pod_body("other", {"job": "y", "role": "worker"}))
    names = {
        p.metadata.name
        for p in core.list_namespaced_pod("default", label_selector="job=x,role=worker").items
    }
    assert names == {made.metadata.name}
    assert len(core.list_namespaced_pod("default", label_selector="role=worker").items) == 2
    assert len(core.list_namespaced_pod("default", label_selector="job!=x").items) == 1


def test_resource_versions_increase_and_a_stale_put_is_409_conflict(
    core: client.CoreV1Api,
) -> None:
    first = core.create_namespaced_config_map(
        "default", {"metadata": {"name": "c"}, "data": {"k": "1"}}
    )
    second = core.replace_namespaced_config_map(
        "c",
        "default",
        {"metadata": {"name": "c", "resourceVersion": first.metadata.resource_version}},
    )
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    with pytest.raises(ApiException) as raised:
        core.replace_namespaced_config_map(
            "c",
            "default",
            {"metadata": {"name": "c", "resourceVersion": first.metadata.resource_version}},
        )
    assert raised.value.status == 409
    assert "Conflict" in raised.value.body


def test_merge_patch_of_labels_and_status(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", pod_body("p", {"a": "1"}))
    patched = core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"b": "2"}}})
    assert patched.metadata.labels == {"a": "1", "b": "2"}
    status = core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}})
    assert status.status.phase == "Running"
    # The main resource cannot change status, as with the real server.
    again = core.patch_namespaced_pod("p", "default", {"status": {"phase": "Failed"}})
    assert again.status.phase == "Running"


def test_forbidden_verbs_answer_403_with_the_rbac_message(
    kube: FakeKube, core: client.CoreV1Api
) -> None:
    kube.deny("create", "pods")
    with pytest.raises(ApiException) as raised:
        core.create_namespaced_pod("default", pod_body("a"))
    assert raised.value.status == 403
    assert 'cannot create resource \\"pods\\"' in raised.value.body
    core.list_namespaced_pod("default")  # other verbs still work
    kube.allow("create", "pods")
    core.create_namespaced_pod("default", pod_body("a"))


def test_injected_faults_fail_requests_as_a_server_or_a_network_does(kube: FakeKube) -> None:
    kube.deny("create", "pods", quota_message("a"))
    configuration = kube.configuration()
    configuration.retries = 0  # see every failure (urllib3 would retry a dropped GET itself)
    with client.ApiClient(configuration) as api:
        core = client.CoreV1Api(api)
        with pytest.raises(ApiException) as raised:
            core.create_namespaced_pod("default", pod_body("a"))
        assert raised.value.status == 403 and "exceeded quota" in raised.value.body
        kube.allow("create", "pods")
        kube.inject("create", "pods", Fault(503, "ServiceUnavailable", after_apply=True))
        kube.inject("list", "pods", Fault(429, "TooManyRequests"), Fault(drop=True))
        kube.inject("get", "pods", Fault(delay=1.0))
        with pytest.raises(ApiException) as raised:
            core.create_namespaced_pod("default", pod_body("a"))
        assert raised.value.status == 503
        assert kube.pod("a") is not None  # served, then failed: the answer was lost
        with pytest.raises(ApiException) as raised:
            core.list_namespaced_pod("default")
        assert raised.value.status == 429
        with pytest.raises(urllib3.exceptions.HTTPError, match="without response"):
            core.list_namespaced_pod("default")  # the connection closed without an answer
        with pytest.raises(urllib3.exceptions.HTTPError, match="Read timed out"):
            core.read_namespaced_pod("a", "default", _request_timeout=0.3)
        assert [p.metadata.name for p in core.list_namespaced_pod("default").items] == ["a"]
    assert [(verb, f.status) for verb, _, f in kube.faults_used] == [
        ("create", 503),
        ("list", 429),
        ("list", 500),
        ("get", 500),
    ]
    assert kube.faults_left("list", "pods") == 0


def watch_events(
    core: client.CoreV1Api, resource_version: str | None, count: int, timeout: int = 5
) -> list[dict[str, Any]]:
    """Up to ``count`` events, or what came before the watch's server-side timeout."""
    events: list[dict[str, Any]] = []
    stream = watch.Watch()
    kwargs: dict[str, Any] = {"timeout_seconds": timeout}
    if resource_version is not None:
        kwargs["resource_version"] = resource_version
    for event in stream.stream(core.list_namespaced_pod, "default", **kwargs):
        events.append(event)
        if len(events) == count:
            stream.stop()
    return events


def test_watch_resumes_after_a_resource_version_in_order(core: client.CoreV1Api) -> None:
    a = core.create_namespaced_pod("default", pod_body("a"))
    core.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"x": "1"}}})
    core.create_namespaced_pod("default", pod_body("b"))
    core.delete_namespaced_pod("b", "default", grace_period_seconds=0)
    events = watch_events(core, a.metadata.resource_version, 3)
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [
        ("MODIFIED", "a"),
        ("ADDED", "b"),
        ("DELETED", "b"),
    ]
    versions = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(a.metadata.resource_version)
    # Without a resourceVersion a watch starts with the current objects as ADDED.
    assert [e["type"] for e in watch_events(core, None, 1)] == ["ADDED"]


def test_watch_streams_live_events(kube: FakeKube, core: client.CoreV1Api) -> None:
    start = str(kube.resource_version)
    seen: list[str] = []
    reader = threading.Thread(
        target=lambda: seen.extend(e["type"] for e in watch_events(core, start, 2))
    )
    reader.start()
    core.create_namespaced_pod("default", pod_body("live"))
    core.delete_namespaced_pod("live", "default", grace_period_seconds=0)
    reader.join(timeout=10)
    assert seen == ["ADDED", "DELETED"]


def test_a_compacted_resource_version_gets_410_gone(kube: FakeKube, core: client.CoreV1Api) -> None:
    old = core.create_namespaced_pod("default", pod_body("a")).metadata.resource_version
    core.create_namespaced_pod("default", pod_body("b"))
    kube.compact()
    with pytest.raises(ApiException) as raised:
        watch_events(core, old, 1)
    assert raised.value.status == 410
    assert "too old resource version" in str(raised.value)
    # A fresh list gives a current resourceVersion from which watching works again.
    listed = core.list_namespaced_pod("default")
    core.create_namespaced_pod("default", pod_body("c"))
    events = watch_events(core, listed.metadata.resource_version, 1)
    assert events[0]["raw_object"]["metadata"]["name"] == "c"


def test_deleting_an_owner_deletes_its_dependents(kube: FakeKube, core: client.CoreV1Api) -> None:
    owner = core.create_namespaced_pod("default", pod_body("owner"))
    dependent = pod_body("dependent")
    dependent["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner.metadata.uid}
    ]
    core.create_namespaced_pod("default", dependent)
    core.create_namespaced_pod("default", pod_body("bystander"))
    core.delete_namespaced_pod("owner", "default")
    kube.wait_for(lambda: kube.pod("dependent") is None, 10, "garbage collection")
    assert kube.pod("bystander") is not None


# -- run_pods: scheduler and kubelet ---------------------------------------------------------

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)"]


@pytest.fixture
def cluster() -> Iterator[FakeKube]:
    with FakeKube(run_pods=True, capacity=1) as fake:
        yield fake


def phase(kube: FakeKube, name: str) -> str | None:
    pod = kube.pod(name)
    return pod["status"]["phase"] if pod else None


def test_pods_run_their_command_with_field_refs_and_capacity_keeps_others_pending(
    cluster: FakeKube,
) -> None:
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        script = "import os; print(os.environ['ME'], os.environ['IP'], os.environ['FIXED'])"
        body = pod_body("echo", command=[sys.executable, "-c", script])
        body["spec"]["containers"][0]["env"] = [
            {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "FIXED", "value": "v"},
        ]
        core.create_namespaced_pod("default", pod_body("sleeper", command=SLEEPER))
        cluster.wait_for(lambda: phase(cluster, "sleeper") == "Running", 10, "sleeper running")
        core.create_namespaced_pod("default", body)
        cluster.wait_for(
            lambda: any(
                c.get("reason") == "Unschedulable"
                for c in (cluster.pod("echo") or {}).get("status", {}).get("conditions", [])
            ),
            10,
            "echo unschedulable",
        )
        assert phase(cluster, "echo") == "Pending"
        cluster.set_capacity(2)
        cluster.wait_for(lambda: phase(cluster, "echo") == "Succeeded", 20, "echo to finish")
        assert cluster.logs("echo") == ["echo 127.0.0.1 v"]
        terminated = cluster.pod("echo")["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 0


def test_delete_sends_sigterm_then_the_pod_disappears(cluster: FakeKube) -> None:
    graceful = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
    graceful += "print('up', flush=True)\nwhile True: time.sleep(0.1)"
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(
            "default", pod_body("g", command=[sys.executable, "-c", graceful])
        )
        cluster.wait_for(lambda: cluster.logs("g") == ["up"], 20, "the pod to start")
        start = str(cluster.resource_version)
        deleted = core.delete_namespaced_pod("g", "default")
        assert deleted.metadata.deletion_timestamp is not None
        cluster.wait_for(lambda: cluster.pod("g") is None, 20, "the pod to go")
        events = watch_events(core, start, 3)
    final = events[-1]["raw_object"]
    assert [e["type"] for e in events][-1] == "DELETED"
    assert final["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


def test_evict_preempt_and_kill_look_like_a_cluster(cluster: FakeKube) -> None:
    cluster.set_capacity(None)
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        for name in ("evicted", "preempted", "killed"):
            core.create_namespaced_pod("default", pod_body(name, command=SLEEPER))
        cluster.wait_for(
            lambda: all(cluster.pid(n) for n in ("evicted", "preempted", "killed")),
            20,
            "pods running",
        )
        start = str(cluster.resource_version)
        cluster.evict("evicted")
        cluster.kill("killed")
        cluster.preempt("preempted")
        cluster.wait_for(
            lambda: (
                phase(cluster, "evicted") == "Failed"
                and phase(cluster, "killed") == "Failed"
                and cluster.pod("preempted") is None
            ),
            30,
            "disruptions",
        )
        evicted = cluster.pod("evicted")["status"]
        assert evicted["reason"] == "Evicted"
        assert {"DisruptionTarget"} <= {c["type"] for c in evicted["conditions"]}
        killed = cluster.pod("killed")["status"]["containerStatuses"][0]["state"]["terminated"]
        assert killed["exitCode"] == SIGKILL_EXIT_CODE
        events = [
            e
            for e in watch_events(core, start, 100, timeout=1)
            if e["raw_object"]["metadata"]["name"] == "preempted"
        ]
    reasons = {
        c.get("reason")
        for e in events
        for c in e["raw_object"].get("status", {}).get("conditions", [])
    }
    assert "PreemptionByScheduler" in reasons
    assert events[-1]["type"] == "DELETED"
