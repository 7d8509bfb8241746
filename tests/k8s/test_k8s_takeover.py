"""A launcher pod that goes is replaced by the next pod of its Job, which adopts the job; the
Kubernetes API's failures during a scale-up are retried.

Real etcd, real Horovod/Gloo and real processes on the fake cluster (tests/helpers/fake_kube.py),
which runs no Job controller: the test plays it, creating each launcher pod with the same command
and environment and the Job as its controller, as the Job controller would after a failure.

1. SIGTERM to the launcher (a drain, an eviction): it hands the job over (exit code 5), the
   worker pods keep running, and the next launcher pod adopts the job;
2. that launcher is SIGKILLed (an OOM kill) and its pod deleted: the worker pods, owned by the
   Job and not by the pod, stay; the next pod waits out the dead one's lease and adopts the job;
   the job finishes with no worker pod restarted.
3. A scale-up meets a ResourceQuota's 403 (said once), then 500s, a dropped connection, a lost
   answer and a 429 on the creates, failures of the watch and of Events: the scale-up completes
   with no duplicate pod, and the launcher never stops.

And a launcher pod that starts while another launcher still leads the job stands by, and
SIGTERM then makes it exit 5 too (the Job's next pod tries again), having changed nothing.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from elastic_allreduce.records import keys
from elastic_allreduce.records.values import LeaderRecord, ScaleTarget
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from launcher.exit_codes import EXIT_HANDED_OVER
from tests.conftest import fresh_job_id
from tests.helpers.fake_kube import FakeKube, Fault, quota_message
from tests.k8s.conftest import PodOutput, join_template, launcher_pod, phase, wait_showing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).parent.parent / "scripts" / "train_until.py")


class LauncherJob:
    """The launcher's Job in the fake, and the Job controller's part: each new launcher pod."""

    def __init__(self, kube: FakeKube, job_id: str, command: list[str], owned: bool) -> None:
        self.kube = kube
        self.job_id = job_id
        self.command = command
        self.pods: list[str] = []
        self.uid: str | None = None
        if owned:
            body = {
                "metadata": {"name": f"{job_id}-launcher"},
                "spec": {"template": {"spec": {"containers": [{"name": "launcher"}]}}},
            }
            with kube.api_client() as api:
                created = client.BatchV1Api(api).create_namespaced_job("default", body)
            self.uid = str(created.metadata.uid)

    def start_pod(self) -> str:
        """A new launcher pod, as the Job controller makes one (a new name each time)."""
        name = f"{self.job_id}-launcher-{len(self.pods)}"
        metadata: dict[str, Any] = {"name": name, "labels": {"elastic-allreduce/role": "launcher"}}
        if self.uid is not None:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": f"{self.job_id}-launcher",
                    "uid": self.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        body = launcher_pod(name, self.command, metadata=metadata)
        with self.kube.api_client() as api:
            client.CoreV1Api(api).create_namespaced_pod("default", body)
        self.pods.append(name)
        return name


def launcher_command(
    job_id: str, etcd: str, folder: Path, kube: FakeKube, *, workers: int
) -> tuple[list[str], Path]:
    """The launcher's command for a job of ``workers`` worker pods (their template written
    into ``folder``), and the file that ends the training when it appears."""
    template, stop = folder / "worker.json", folder / "stop"
    template.write_text(json.dumps(join_template()))
    return [
        "elastic-run", "run", "--kubernetes", "--worker-template", str(template),
        "--kube-api", kube.url, "--etcd", etcd, "--job-id", job_id,
        "--workers", str(workers), "--min-workers", "1", "--max-workers", "2",
        "--max-restarts", "2",
        "--", "python", SCRIPT, "--stop-file", str(stop), "--step-delay", "0.03",
    ], stop  # fmt: skip


def worker_pods(kube: FakeKube, job_id: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in kube.pods()
        if p["metadata"].get("labels", {}).get("elastic-allreduce/role") == "worker"
        and p["metadata"]["labels"].get("elastic-allreduce/job") == job_id
    }


def exit_code(pod: dict[str, Any] | None) -> int | None:
    for status in (pod or {}).get("status", {}).get("containerStatuses", []):
        terminated = status.get("state", {}).get("terminated")
        if terminated:
            return int(terminated["exitCode"])
    return None


def log_of(output: PodOutput, pod: str) -> str:
    return "\n".join(output.of(pod))


def test_the_next_launcher_pod_adopts_the_job_after_a_handover_and_after_a_kill(
    etcd_server: EmbeddedEtcd, kube: FakeKube, output: PodOutput, tmp_path: Path
) -> None:
    job_id = fresh_job_id("adopt")
    command, stop = launcher_command(job_id, etcd_server.endpoints_text, tmp_path, kube, workers=2)
    job = LauncherJob(kube, job_id, command, owned=True)
    first = job.start_pod()
    wait_showing(kube, output, lambda: len(output.commits(2)) >= 4, 120, "commits at size 2")
    workers = {name: kube.pid(name) for name in worker_pods(kube, job_id)}
    assert len(workers) == 2 and all(workers.values()), workers
    for pod in worker_pods(kube, job_id).values():
        [owner] = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"]) == ("Job", job.uid)

    # 1. SIGTERM (what a drain's eviction sends): the job is handed over, exit code 5.
    os.kill(kube.pid(first) or 0, signal.SIGTERM)
    wait_showing(kube, output, lambda: phase(kube.pod(first)) == "Failed", 60, "the handover")
    assert exit_code(kube.pod(first)) == EXIT_HANDED_OVER, log_of(output, first)
    assert f"handed job {job_id} over" in log_of(output, first)
    # The pod that made the worker pods is deleted (by hand, or the cluster's pod GC): they
    # belong to the Job, so they stay.
    with kube.api_client() as api:
        client.CoreV1Api(api).delete_namespaced_pod(first, "default")
    commits = len(output.commits(2))
    wait_showing(
        kube, output, lambda: len(output.commits(2)) >= commits + 2, 30, "training goes on"
    )
    second = job.start_pod()
    wait_showing(
        kube,
        output,
        lambda: f"taking over job {job_id}" in log_of(output, second),
        60,
        "the second launcher to adopt the job",
    )

    # 2. SIGKILL (an OOM kill) and the pod deleted: the workers stay, the next pod adopts.
    adopted = "took over ring epoch"
    wait_showing(kube, output, lambda: adopted in log_of(output, second), 30, "the ring")
    kube.kill(second)
    wait_showing(kube, output, lambda: phase(kube.pod(second)) == "Failed", 30, "the kill")
    with kube.api_client() as api:
        client.CoreV1Api(api).delete_namespaced_pod(second, "default")
    third = job.start_pod()  # at once: the killed launcher's lease has not lapsed yet
    wait_showing(
        kube,
        output,
        lambda: f"taking over job {job_id}" in log_of(output, third),
        60,
        "the third launcher to adopt the job",
    )
    commits = len(output.commits(2))
    wait_showing(
        kube, output, lambda: len(output.commits(2)) >= commits + 2, 30, "training goes on"
    )
    # No worker pod was deleted, restarted or added through all of it; each launcher adopted
    # them (to report their losses, stop them on a scale-down, delete them at the end).
    assert {name: kube.pid(name) for name in worker_pods(kube, job_id)} == workers
    for pod in worker_pods(kube, job_id).values():
        assert phase(pod) == "Running" and not pod["metadata"].get("deletionTimestamp"), pod
    for launcher in (second, third):
        assert log_of(output, launcher).count("adopted pod") == 2, log_of(output, launcher)

    stop.touch()
    wait_showing(
        kube,
        output,
        lambda: phase(kube.pod(third)) in ("Succeeded", "Failed"),
        60,
        "the job to end",
    )
    assert phase(kube.pod(third)) == "Succeeded", log_of(output, third)
    done = output.done()
    assert len(done) == 2 and len({r["checksum"] for r in done}) == 1, done
    # The adopting launcher deletes the pods it adopted.
    wait_showing(kube, output, lambda: not worker_pods(kube, job_id), 60, "the pods to go")


def test_api_failures_during_a_scale_up_are_retried_and_a_quota_refusal_is_said_once(
    etcd_server: EmbeddedEtcd, kube: FakeKube, output: PodOutput, tmp_path: Path
) -> None:
    job_id = fresh_job_id("apierr")
    command, stop = launcher_command(job_id, etcd_server.endpoints_text, tmp_path, kube, workers=1)
    launcher = LauncherJob(kube, job_id, command, owned=False).start_pod()
    wait_showing(kube, output, lambda: len(output.commits(1)) >= 3, 120, "commits at size 1")

    def creates() -> int:
        return sum(1 for m, p in kube.requests if m == "POST" and p.endswith("/pods"))

    # The namespace's quota is used up: the scale-up waits, said once, and nothing fails.
    kube.deny("create", "pods", quota_message(f"{job_id}-worker-1", used=2))
    before = creates()
    with EtcdStore(etcd_server.endpoints_text, job_id) as store:
        store.put(keys.SCALE_TARGET, ScaleTarget(2).to_json())
    wait_showing(kube, output, lambda: creates() >= before + 2, 30, "2 refused creates")
    # Then the quota frees up while the API server has a bad minute.
    kube.inject(
        "create",
        "pods",
        Fault(500),
        Fault(drop=True),
        Fault(429, "TooManyRequests"),
        Fault(503, "ServiceUnavailable", after_apply=True),  # created; the answer is lost
    )
    kube.inject("create", "events", Fault(500), Fault(504, "Timeout"))
    kube.inject("watch", "pods", Fault(500), Fault(drop=True))
    kube.drop_watches()
    kube.allow("create", "pods")
    wait_showing(kube, output, lambda: len(output.commits(2)) >= 3, 120, "commits at size 2")

    assert kube.faults_left("create", "pods") == kube.faults_left("watch", "pods") == 0
    assert sorted(worker_pods(kube, job_id)) == [f"{job_id}-worker-0", f"{job_id}-worker-1"]
    lines = output.of(launcher)
    refusals = [line for line in lines if "cannot create worker pods" in line]
    assert len(refusals) == 1, "\n".join(lines)
    assert "exceeded quota" in refusals[0] and "ResourceQuota is used up" in refusals[0]
    assert len([line for line in lines if "creating a worker pod failed" in line]) == 1
    assert len([line for line in lines if "the pod watch failed" in line]) == 1
    assert phase(kube.pod(launcher)) == "Running"
    assert any(e["reason"] == "Joined" for e in kube.events())
    assert kube.faults_left("create", "events") == 0

    stop.touch()
    wait_showing(
        kube,
        output,
        lambda: phase(kube.pod(launcher)) in ("Succeeded", "Failed"),
        60,
        "the job to end",
    )
    assert phase(kube.pod(launcher)) == "Succeeded", "\n".join(output.of(launcher))


def test_a_launcher_standing_by_exits_5_on_sigterm_and_changes_nothing(
    etcd_server: EmbeddedEtcd, kube: FakeKube, tmp_path: Path
) -> None:
    job_id = fresh_job_id("standby")
    with EtcdStore(etcd_server.endpoints_text, job_id) as store:
        # Another launcher leads the job (the pod before, whose lease has not lapsed yet).
        lease = store.grant_lease(30)
        store.put(keys.LEADER, LeaderRecord("10.0.0.9:4000").to_json(), lease=lease)
        command, _ = launcher_command(job_id, etcd_server.endpoints_text, tmp_path, kube, workers=1)
        command[0] = str(Path(sys.executable).parent / "elastic-run")
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            for line in process.stdout or []:
                lines.put(line)

        reader = threading.Thread(target=read)
        reader.start()
        seen: list[str] = []
        deadline = time.monotonic() + 60
        try:
            while not any("standing by" in line for line in seen):
                assert time.monotonic() < deadline, "".join(seen)
                try:
                    seen.append(lines.get(timeout=1))
                except queue.Empty:
                    assert process.poll() is None, "".join(seen)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == EXIT_HANDED_OVER, "".join(seen)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            reader.join(timeout=10)
        while not lines.empty():
            seen.append(lines.get())
        assert "SIGTERM before this launcher led the job" in "".join(seen), "".join(seen)
        # Nothing was written: the job is still the other launcher's, no pod was made.
        assert store.get(keys.JOB_CONFIG) is None
        leader = store.get(keys.LEADER)
        assert leader is not None and leader.lease == lease.id
        assert not [m for m, p in kube.requests if m == "POST"]
        lease.revoke()
