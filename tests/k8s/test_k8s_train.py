"""`elastic-run k8s render|submit ... -- train --model-def ...` (issue #18): the model zoo's
built-in loop as a Kubernetes job.

- Rendering (no cluster): the launcher Job runs `elastic-run run --kubernetes` with the job
  flags, and its training command is the runner's (`python -m elastic_allreduce.zoo.run train`)
  with the given training flags, the pods' paths unexpanded; a bad training flag is one error
  line and exit code 2.
- End to end on the fake Kubernetes API (tests/helpers/fake_kube.py: scheduler and kubelet,
  pods as local processes), with real etcd, Horovod/Gloo and processes: the launcher pod runs
  the rendered launcher Job's command (`elastic-run run --kubernetes ... -- python -m
  elastic_allreduce.zoo.run train ...`), its worker pods are made from the rendered worker
  template (`elastic-run join`), and `digits_cnn.py` trains one epoch on 2 ranks; rank 0 exports
  the model; the launcher pod succeeds and deletes its worker pods.

What the fake cannot give, the test stands in for, and only that: the ConfigMap mount of the
worker template is a local file, Kubernetes' `$(VAR)` expansion of the launcher's arguments is
done here, the launcher gets `--kube-api` (no service-account token), and the worker pods' Gloo
interface is loopback (every fake pod has the IP 127.0.0.1). The definition and the data are at
the same paths for the "image" and the "volume": this machine's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from elastic_allreduce import env
from elastic_allreduce.store import EmbeddedEtcd
from elastic_allreduce.training import audit
from elastic_allreduce.zoo import options as train_flags
from launcher.cli import main
from launcher.k8s import naming
from launcher.zoo import RUNNER
from tests.conftest import ROOT, fresh_job_id
from tests.helpers.fake_kube import FakeKube
from tests.k8s.conftest import PodOutput, phase, wait_showing

ZOO = ROOT / "examples" / "model_zoo"
DIGITS_DEF = ZOO / "digits_cnn.py"
DIGITS_TRAIN, GLOBAL_BATCH = 1437, 64
IMAGE = "elastic-allreduce:dev"
NAMESPACE = "default"

Manifest = dict[str, Any]


# -- helpers -----------------------------------------------------------------------------------


def render(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`elastic-run k8s render ARGV`, in this process: exit code, stdout, stderr."""
    code = main(["k8s", "render", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def rendered(out: str, kind: str) -> Manifest:
    (found,) = [doc for doc in yaml.safe_load_all(out) if doc and doc["kind"] == kind]
    return found


def launcher_container(job: Manifest) -> Manifest:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def parse_train_flags(argv: list[str]) -> train_flags.TrainOptions:
    parser = argparse.ArgumentParser(prog="train")
    train_flags.add_train_flags(parser)
    return train_flags.from_args(parser.parse_args(argv))


# -- render ------------------------------------------------------------------------------------

TRAIN_FLAGS = [
    *("--model-def", "/app/digits_cnn.py"),
    *("--training-data", "/data/digits/train-*.tfrecord"),
    *("--validation-data", "/data/digits/valid-*.tfrecord"),
    *("--epochs", "3", "--global-batch", "64", "--output", "/data/out/zoo-1"),
]


def test_render_runs_a_train_command_as_the_runner_under_the_kubernetes_launcher(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = render(
        capsys,
        *("--image", IMAGE, "--job-id", "zoo-1", "--workers", "4", "--max-restarts", "2"),
        *("--", "train", *TRAIN_FLAGS),
    )
    assert (code, err) == (0, "")
    container = launcher_container(rendered(out, "Job"))
    argv = [*container["command"], *container["args"]]
    assert argv[:3] == ["elastic-run", "run", "--kubernetes"], argv
    dashdash = argv.index("--")
    job_flags, command = argv[:dashdash], argv[dashdash + 1 :]
    assert job_flags[job_flags.index("--job-id") + 1] == "zoo-1"
    assert job_flags[job_flags.index("--workers") + 1] == "4"
    assert job_flags[job_flags.index("--max-restarts") + 1] == "2"
    assert command[:4] == ["python", "-m", RUNNER, "train"], command
    # The same training options, the pods' paths as given: nothing expanded or made absolute.
    assert parse_train_flags(command[4:]) == parse_train_flags(TRAIN_FLAGS)
    assert "/data/digits/train-*.tfrecord" in command and "/app/digits_cnn.py" in command
    # Worker pods only run `elastic-run join`: the command reaches them through the store.
    template = yaml.safe_load(rendered(out, "ConfigMap")["data"][naming.TEMPLATE_KEY])
    assert template["spec"]["containers"][0]["command"] == ["elastic-run", "join"]


GOOD = ("--model-def", "/app/m.py", "--training-data", "/data/t-*")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([*GOOD, "--epochs", "0"], "--epochs must be at least 1"),
        ([*GOOD, "--epochs", "two"], "--epochs"),
        ([*GOOD, "--bogus", "1"], "--bogus"),
        (GOOD[2:], "--model-def"),  # required, missing
    ],
    ids=["epochs-0", "epochs-not-a-number", "unknown-flag", "no-model-def"],
)
def test_a_bad_train_flag_fails_render_with_one_error_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    code, out, err = render(capsys, "--image", IMAGE, "--job-id", "zoo-1", "--", "train", *flags)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("elastic-run k8s render: error: "), err
    assert says in lines[0], err


# -- end to end on the fake cluster -------------------------------------------------------------


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits TFRecords, as tests/integration/test_zoo.py makes them: what would be on the
    data volume."""
    out = tmp_path_factory.mktemp("k8s-zoo") / "digits"
    made = subprocess.run(
        [sys.executable, str(ZOO / "make_data.py"), "digits", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert made.returncode == 0, made.stdout + made.stderr
    return out


def worker_pods(kube: FakeKube, job_id: str) -> dict[str, Manifest]:
    return {
        p["metadata"]["name"]: p
        for p in kube.pods()
        if p["metadata"].get("labels", {}).get(naming.JOB_LABEL) == job_id
        and p["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
    }


def worker_template(config_map: Manifest, sample_log: Path) -> Manifest:
    """The rendered worker template, with loopback for Gloo (the fake's pods share this machine's
    network) and the sample audit log on."""
    template = yaml.safe_load(config_map["data"][naming.TEMPLATE_KEY])
    (container,) = template["spec"]["containers"]
    variables = container["env"]
    iface = [v for v in variables if v["name"] == env.GLOO_IFACE]
    assert iface == [{"name": env.GLOO_IFACE, "value": "eth0"}], variables
    iface[0]["value"] = "lo"
    variables.append({"name": env.SAMPLE_LOG, "value": str(sample_log)})
    return template


def launcher_pod(job: Manifest, template_file: Path, kube: FakeKube) -> Manifest:
    """The pod the launcher Job's controller would create, as the fake can run it."""
    pod_template = json.loads(json.dumps(job["spec"]["template"]))
    (container,) = pod_template["spec"]["containers"]
    args = list(container["args"])
    at = args.index("--worker-template") + 1
    assert args[at] == naming.TEMPLATE_PATH  # the ConfigMap's mount
    args[at] = str(template_file)
    args = [_expand(a, {env.NAMESPACE: NAMESPACE}) for a in args]  # from the pod's env
    dashdash = args.index("--")
    container["args"] = [*args[:dashdash], "--kube-api", kube.url, *args[dashdash:]]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": job["metadata"]["name"],  # the Job's name: <job-id>-launcher
            "labels": pod_template["metadata"]["labels"],
        },
        "spec": pod_template["spec"],
    }


def _expand(arg: str, values: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` in container arguments, for the variables the test knows."""
    for name, value in values.items():
        arg = arg.replace(f"$({name})", value)
    assert "$(" not in arg, arg
    return arg


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rendered_train_job_trains_the_digits_on_two_worker_pods_and_exports(
    etcd_server: EmbeddedEtcd,
    kube: FakeKube,
    output: PodOutput,
    *,
    digits: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job_id = fresh_job_id("kzoo")
    model_dir, sample_log = tmp_path / "model", tmp_path / "samples"
    code, out, err = render(
        capsys,
        *("--image", IMAGE, "--job-id", job_id, "--namespace", NAMESPACE),
        *("--etcd", etcd_server.endpoints_text, "--etcd-plaintext"),
        *("--no-priority-class", "--no-network-policy"),
        # Both workers in the first ring, however long their first TensorFlow import takes on a
        # loaded machine: the test counts every step each one ran, in one ring of 2.
        *("--workers", "2", "--max-restarts", "0", "--start-grace", "120"),
        "--",
        "train",
        *("--model-def", str(DIGITS_DEF)),
        *("--training-data", f"{digits}/train-*.tfrecord"),
        *("--validation-data", f"{digits}/valid-*.tfrecord"),
        *("--epochs", "1", "--global-batch", str(GLOBAL_BATCH), "--output", str(model_dir)),
    )
    assert (code, err) == (0, ""), err
    template_file = tmp_path / "worker-pod.yaml"
    template_file.write_text(
        yaml.safe_dump(worker_template(rendered(out, "ConfigMap"), sample_log))
    )
    pod = launcher_pod(rendered(out, "Job"), template_file, kube)
    launcher = pod["metadata"]["name"]
    assert launcher == naming.launcher_name(job_id)
    command = pod["spec"]["containers"][0]["args"]
    assert command[command.index("--") + 1 :][:4] == ["python", "-m", RUNNER, "train"]

    with kube.api_client() as api:
        client.CoreV1Api(api).create_namespaced_pod(NAMESPACE, pod)

        # Two worker pods are created; they stay until the launcher is done with them.
        wait_showing(
            kube, output, lambda: len(worker_pods(kube, job_id)) == 2, 60, "two worker pods"
        )
        workers = set(worker_pods(kube, job_id))
        wait_showing(
            kube,
            output,
            lambda: phase(kube.pod(launcher)) in ("Succeeded", "Failed"),
            240,
            "the launcher to finish",
        )
        finished = kube.pod(launcher)
        assert phase(finished) == "Succeeded", output.tail()
        (status,) = finished["status"]["containerStatuses"]
        assert status["state"]["terminated"]["exitCode"] == 0, output.tail()
        # The launcher deletes its worker pods before it exits.
        assert worker_pods(kube, job_id) == {}, {
            n: phase(p) for n, p in worker_pods(kube, job_id).items()
        }
        assert not any(kube.pid(name) for name in workers)

    launcher_log = "\n".join(output.of(launcher))
    print(launcher_log)  # shown by pytest -rP or on failure
    assert f"elastic-run: job {job_id} succeeded" in launcher_log, output.tail()

    # Both ranks trained, in one ring of size 2, on both worker pods.
    slots = {f"{name}.0" for name in workers}
    commits = output.events("commit")
    assert commits, output.tail()
    assert all(r["size"] == 2 for _, r in commits), [r for _, r in commits]
    assert {p.slot for p, _ in commits} <= slots and {p.rank for p, _ in commits} == {0}
    steps = math.ceil(DIGITS_TRAIN / GLOBAL_BATCH)
    assert commits[-1][1]["step"] == steps, [r for _, r in commits]
    (report,) = audit.check(sample_log, DIGITS_TRAIN)
    assert report.ok and report.steps == steps, report
    ranks_of: dict[str, set[int]] = {}
    for path in sample_log.glob("*.jsonl"):
        lines = [json.loads(raw) for raw in path.read_text().splitlines()]
        ranks_of[path.stem] = {line["rank"] for line in lines}
        assert len(lines) == steps, (path.name, len(lines))
    assert set(ranks_of) == slots, ranks_of
    assert sorted(r for ranks in ranks_of.values() for r in ranks) == [0, 1], ranks_of

    # Rank 0 exported the model and the summary of one epoch.
    (done,) = output.events("done")
    assert done[0].rank == 0
    assert (model_dir / "model.keras").is_file(), sorted(p.name for p in model_dir.iterdir())
    summary = json.loads((model_dir / "summary.json").read_text())
    print({k: summary[k] for k in ("steps", "epochs", "final_metrics", "rings")})
    assert summary["steps"] == steps and summary["epochs"] == 1, summary
    assert summary["samples_per_epoch"] == DIGITS_TRAIN, summary
    assert [r["ranks"] for r in summary["rings"]] == [2], summary["rings"]
    accuracy = summary["final_metrics"].get("accuracy")
    assert isinstance(accuracy, float) and 0.5 < accuracy <= 1.0, summary["final_metrics"]
    assert summary["final_metrics"] == done[1]["final_metrics"]
