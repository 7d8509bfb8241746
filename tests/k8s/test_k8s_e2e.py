"""The launcher in Kubernetes mode trains a real job on pods of the fake cluster.

Real etcd, real Horovod/Gloo and real processes: the fake API server plays scheduler and
kubelet, so the launcher itself runs as a pod (`elastic-run run --kubernetes`), creates worker
pods whose container is just `elastic-run join`, and sees them through the API. The schedule:

1. capacity leaves one of three worker pods Pending: the job trains with the two that run;
2. capacity is raised: the pending pod starts and joins (size 3);
3. a worker pod is SIGKILLed: the job goes on and a replacement pod joins;
4. a worker pod is preempted (SIGTERM, then it is gone): a graceful leave, and a replacement;
5. the test asks training to stop: every rank finishes with the same weights, the launcher pod
   succeeds, its worker pods are deleted, and its Events tell the story.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from elastic_allreduce.store import EmbeddedEtcd
from tests.conftest import fresh_job_id
from tests.helpers.fake_kube import FakeKube
from tests.k8s.conftest import PodOutput, join_template, launcher_pod, phase, wait_showing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_until.py")


def launcher_job_pod(
    job_id: str, etcd: str, template: Path, stop_file: Path, kube: FakeKube
) -> dict[str, Any]:
    command = [
        "elastic-run", "run", "--kubernetes", "--worker-template", str(template),
        "--kube-api", kube.url, "--etcd", etcd, "--job-id", job_id,
        "--workers", "3", "--min-workers", "2", "--max-workers", "3", "--max-restarts", "4",
        "--", "python", SCRIPT, "--stop-file", str(stop_file), "--step-delay", "0.03",
    ]  # fmt: skip
    return launcher_pod(f"{job_id}-launcher", command)


@pytest.fixture
def kube(output: PodOutput) -> Iterator[FakeKube]:
    # One node for the launcher and two workers: the third worker pod stays Pending.
    with FakeKube(run_pods=True, capacity=3, on_output=output) as fake:
        yield fake


def worker_pods(kube: FakeKube, job_id: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in kube.pods()
        if p["metadata"].get("labels", {}).get("elastic-allreduce/job") == job_id
    }


def committed_at(output: PodOutput, pod: str, size: int) -> bool:
    return any(r.get("slot") == f"{pod}.0" for r in output.commits(size))


def test_launcher_in_kubernetes_mode_survives_kill_and_preemption_and_grows(
    etcd_server: EmbeddedEtcd, kube: FakeKube, output: PodOutput, tmp_path: Path
) -> None:
    job_id = fresh_job_id("kube")
    template = tmp_path / "worker.json"
    template.write_text(json.dumps(join_template()))
    stop_file = tmp_path / "stop"
    launcher_name = f"{job_id}-launcher"
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(
            "default",
            launcher_job_pod(job_id, etcd_server.endpoints_text, template, stop_file, kube),
        )

        # 1. Two worker pods run, the third stays Pending; training does not wait for it.
        wait_showing(kube, output, lambda: len(output.commits(2)) >= 6, 120, "commits at size 2")
        pods = worker_pods(kube, job_id)
        pending = [n for n, p in pods.items() if phase(p) == "Pending"]
        assert len(pods) == 3 and len(pending) == 1, {n: phase(p) for n, p in pods.items()}
        (late,) = pending

        # 2. Room for it: the pending pod starts and joins.
        kube.set_capacity(10)
        wait_showing(kube, output, lambda: committed_at(output, late, 3), 120, f"{late} to join")

        # 3. A worker pod is SIGKILLed: a replacement pod joins and the job goes on at size 3.
        victim = sorted(worker_pods(kube, job_id))[0]
        before = set(worker_pods(kube, job_id))
        kube.kill(victim)

        def replaced(old: set[str]) -> str | None:
            new = set(worker_pods(kube, job_id)) - old
            return next((n for n in sorted(new) if committed_at(output, n, 3)), None)

        wait_showing(
            kube, output, lambda: replaced(before) is not None, 150, "a replacement to join"
        )
        assert phase(worker_pods(kube, job_id)[victim]) == "Failed"

        # 4. A worker pod is preempted: it leaves gracefully and a replacement joins.
        preempted = replaced(before)
        assert preempted is not None
        before = set(worker_pods(kube, job_id))
        kube.preempt(preempted)
        wait_showing(
            kube, output, lambda: replaced(before) is not None, 150, "a second replacement"
        )
        assert preempted not in worker_pods(kube, job_id)

        # 5. Training stops when asked; the launcher pod succeeds and cleans up its workers.
        stop_file.touch()
        wait_showing(
            kube,
            output,
            lambda: phase(kube.pod(launcher_name) or {}) in ("Succeeded", "Failed"),
            120,
            "the launcher to finish",
        )
        assert phase(kube.pod(launcher_name) or {}) == "Succeeded", output.tail()
        wait_showing(
            kube,
            output,
            lambda: (
                all(phase(p) in ("Succeeded", "Failed") for p in worker_pods(kube, job_id).values())
                and not any(kube.pid(n) for n in worker_pods(kube, job_id))
            ),
            60,
            "worker pods to stop",
        )

    done = output.done()
    assert len(done) == 3, output.tail()
    assert len({r["checksum"] for r in done}) == 1 and len({r["step"] for r in done}) == 1, done
    launcher_log = "\n".join(line for pod, line in output.lines if pod == launcher_name)
    print(launcher_log)  # shown by pytest -rP or on failure
    assert f"node {victim} was lost: pod failed" in launcher_log
    assert f"node {preempted} was lost: pod preempted by the scheduler" in launcher_log

    events = [e for e in kube.events() if e["involvedObject"]["name"] == launcher_name]
    reasons = {e["reason"] for e in events}
    assert {"Joined", "Left", "Crashed", "Reformed"} <= reasons, [
        (e["reason"], e["message"]) for e in events
    ]
    assert all(
        e["involvedObject"]["uid"] == kube.pod(launcher_name)["metadata"]["uid"] for e in events
    )
    assert any(e["type"] == "Warning" and victim in e["message"] for e in events)
    annotations = kube.pod(launcher_name)["metadata"].get("annotations", {})
    assert annotations.get("elastic-allreduce/ring", "").startswith("epoch ")
