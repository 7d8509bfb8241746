"""Events on the launcher's pod, and the `elastic-run run --kubernetes` command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from kubernetes import client

from launcher import cli
from launcher.k8s.events import EventRecorder
from launcher.k8s.naming import RING_ANNOTATION
from launcher.k8s.retry import Backoff
from launcher.vocabulary import ChangeKind, MembershipChange
from tests.helpers.fake_kube import FakeKube, Fault


def launcher_pod(kube: FakeKube) -> str:
    with kube.api_client() as api:
        body = {"metadata": {"name": "job-launcher"}, "spec": {"containers": [{"name": "l"}]}}
        created = client.CoreV1Api(api).create_namespaced_pod("default", body)
        return str(created.metadata.uid)


def test_membership_changes_become_events_on_the_launcher_pod(fake_kube: FakeKube) -> None:
    uid = launcher_pod(fake_kube)
    with fake_kube.kube() as kube:
        recorder = EventRecorder(kube, "default", "job-launcher", uid, "job")
        recorder(MembershipChange(ChangeKind.JOINED, 2, ("w-3.0",), "epoch 2: w-3.0 joined"))
        recorder(MembershipChange(ChangeKind.CRASHED, 2, ("w-1.0",), "slot w-1.0 crashed"))
        recorder(MembershipChange(ChangeKind.REFORMED, 3, ("w-0.0", "w-3.0"), "epoch 3 running"))
        recorder.close()
    events = sorted(fake_kube.events(), key=lambda e: int(e["metadata"]["resourceVersion"]))
    assert [(e["reason"], e["type"]) for e in events] == [
        ("Joined", "Normal"),
        ("Crashed", "Warning"),
        ("Reformed", "Normal"),
    ]
    for event in events:
        assert event["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "job-launcher",
            "namespace": "default",
            "uid": uid,
        }
        assert event["message"].startswith("job job: ")
        assert event["metadata"]["labels"]["elastic-allreduce/job"] == "job"
    annotations = fake_kube.pod("job-launcher")["metadata"]["annotations"]  # type: ignore[index]
    assert annotations[RING_ANNOTATION] == "epoch 3: 2 ranks [w-0.0,w-3.0]"


def test_a_forbidden_event_is_logged_once_and_never_fails_the_job(
    fake_kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    uid = launcher_pod(fake_kube)
    fake_kube.deny("create", "events")
    with caplog.at_level(logging.WARNING), fake_kube.kube() as kube:
        recorder = EventRecorder(kube, "default", "job-launcher", uid, "job")
        for epoch in (1, 2):
            recorder(MembershipChange(ChangeKind.JOINED, epoch, ("a.0",), "joined"))
        recorder.close()
    warnings = [r.getMessage() for r in caplog.records if "cannot record" in r.getMessage()]
    assert len(warnings) == 1 and "403" in warnings[0] and "apply k8s/" in warnings[0]
    assert fake_kube.events() == []


def test_transient_failures_of_events_are_retried_without_duplicates(
    fake_kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    uid = launcher_pod(fake_kube)
    fake_kube.inject(
        "create",
        "events",
        Fault(500),
        Fault(drop=True),
        Fault(503, "ServiceUnavailable", after_apply=True),  # created: the answer was lost
    )
    fake_kube.inject("patch", "pods", Fault(429, "TooManyRequests"), Fault(504))
    with caplog.at_level(logging.WARNING), fake_kube.kube() as kube:
        recorder = EventRecorder(
            kube, "default", "job-launcher", uid, "job", backoff=Backoff(first=0.05, cap=0.2)
        )
        recorder(MembershipChange(ChangeKind.JOINED, 1, ("a.0",), "a.0 joined"))
        recorder(MembershipChange(ChangeKind.REFORMED, 1, ("a.0",), "epoch 1 running"))
        recorder.close()
    assert sorted(e["reason"] for e in fake_kube.events()) == ["Joined", "Reformed"]
    assert recorder.recorded == 2
    annotations = fake_kube.pod("job-launcher")["metadata"]["annotations"]  # type: ignore[index]
    assert annotations[RING_ANNOTATION] == "epoch 1: 1 ranks [a.0]"
    assert fake_kube.faults_left("create", "events") == fake_kube.faults_left("patch", "pods") == 0
    assert not [r for r in caplog.records if "cannot" in r.getMessage()]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["run", *args])
    return code, capsys.readouterr().err


def test_kubernetes_mode_needs_a_worker_template_and_an_etcd(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASTIC_ALLREDUCE_ETCD", raising=False)
    code, err = run_cli(capsys, "--kubernetes", "--", "python", "train.py")
    assert code == 2 and "--kubernetes needs --worker-template FILE" in err
    template = tmp_path / "worker.yaml"
    template.write_text("kind: Deployment\n")
    code, err = run_cli(
        capsys, "--kubernetes", "--worker-template", str(template), "--", "python", "t.py"
    )
    assert code == 2 and "must be a Pod manifest (kind: Pod), got 'Deployment'" in err
    template.write_text(json.dumps({"kind": "Pod", "spec": {"containers": [{"name": "w"}]}}))
    code, err = run_cli(
        capsys, "--kubernetes", "--worker-template", str(template), "--", "python", "t.py"
    )
    assert code == 2 and "--kubernetes needs an etcd that worker pods can reach" in err
    code, err = run_cli(
        capsys, "--kubernetes", "--worker-template", str(tmp_path / "missing.yaml"), "--", "x"
    )
    assert code == 2 and "cannot read the worker template" in err


def test_kubernetes_mode_reads_a_train_command_as_the_model_zoo_runner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A hand-written launcher pod (`run --kubernetes -- train ...`) gets the same conversion
    # as `k8s render`: the train flags are checked here, before any pod exists.
    code, err = run_cli(capsys, "--kubernetes", "--", "train", "--model-def", "m.py")
    assert code == 2 and "the training command `train ...`" in err, err
    assert "--training-data" in err, err
