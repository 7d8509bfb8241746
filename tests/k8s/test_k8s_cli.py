"""`elastic-run k8s render|submit|status|delete`: flags, errors, and the calls against the fake
Kubernetes API (tests/helpers/fake_kube.py), through a kubeconfig as a user would.

Exit codes: 2 for bad input (flags, kubeconfig, a missing namespace, etcd or PriorityClass, an
unknown job), 3 for operational failures (the API unreachable, RBAC refusals, conflicts)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.cli import _build_parser, main
from launcher.job_options import GROUP_TITLE, job_options
from launcher.job_options import from_args as job_options_from_args
from launcher.k8s import manifests, naming
from launcher.k8s.client import KINDS, Kube, connect
from tests.helpers.fake_kube import FakeKube

NS = "ml"
IMAGE = "registry.example.com/ea:1"
COMMAND = ["--", "python", "train.py", "--epochs", "3"]
JOB_KINDS = (
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "Job",
)


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "not-checked-by-the-fake"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(namespaces=("default", NS)) as kube:
        yield kube


@pytest.fixture
def kubeconfig(fake: FakeKube, tmp_path: Path) -> str:
    return str(write_kubeconfig(tmp_path / "kubeconfig", fake.url))


@pytest.fixture
def kube(kubeconfig: str) -> Iterator[Kube]:
    with connect(kubeconfig) as client:
        yield client


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def submit(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, *extra: str, namespace: str = NS
) -> tuple[int, str, str]:
    return run(
        capsys,
        "k8s",
        "submit",
        "--kubeconfig",
        kubeconfig,
        "--image",
        IMAGE,
        "--namespace",
        namespace,
        "--job-id",
        "demo",
        *extra,
        *COMMAND,
    )


def names(kube: Kube, kind: str, namespace: str | None = NS) -> set[str]:
    return {o["metadata"]["name"] for o in kube.list(KINDS[kind], namespace, "")}


# -- render ------------------------------------------------------------------------------------


def test_render_prints_the_jobs_manifests(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "k8s", "render", "--image", IMAGE, "--job-id", "demo", "--namespace", NS, *COMMAND
    )
    assert (code, err) == (0, "")
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    assert [o["kind"] for o in objects] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "ConfigMap",
        "NetworkPolicy",
        "NetworkPolicy",
        "NetworkPolicy",
        "Job",
    ]
    assert all(o["metadata"]["namespace"] == NS for o in objects)
    job = objects[-1]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--") :] == COMMAND
    assert args[args.index("--job-id") + 1] == "demo"
    assert args[args.index("--metrics-port") + 1] == "9090"


@pytest.mark.parametrize(
    ("flags", "port"),
    [((), "9090"), (("--metrics-port", "8000"), "8000"), (("--no-metrics",), None)],
)
def test_render_opens_the_metrics_port_for_scrapers_unless_told_not_to(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], port: str | None
) -> None:
    code, out, err = run(
        capsys, "k8s", "render", "--image", IMAGE, "--job-id", "d", *flags, *COMMAND
    )
    assert (code, err) == (0, "")
    job = next(doc for doc in yaml.safe_load_all(out) if doc and doc["kind"] == "Job")
    annotations = job["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port") == port


def test_render_refuses_a_metrics_port_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "k8s", "render", "--image", IMAGE, "--job-id", "d", "--metrics-port", "0", *COMMAND
    )
    assert code == 2 and out == "" and "invalid --metrics-port 0" in err


def test_render_with_gpus_and_a_shared_etcd(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "k8s",
        "render",
        "--image",
        IMAGE,
        "--job-id",
        "gpu",
        "--gpus-per-node",
        "2",
        "--min-workers",
        "2",
        "--max-workers",
        "8",
        "--workers",
        "4",
        "--with-etcd",
        "--with-priority-class",
        "--node-selector",
        "pool=a100",
        "--toleration",
        "dedicated=ml:NoExecute",
        *COMMAND,
    )
    assert code == 0
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    kinds = [o["kind"] for o in objects]
    assert kinds[0] == "PriorityClass"
    assert kinds.count("StatefulSet") == 1
    template = yaml.safe_load(
        next(o for o in objects if o["kind"] == "ConfigMap")["data"][naming.TEMPLATE_KEY]
    )
    spec = template["spec"]
    assert spec["containers"][0]["resources"]["limits"][naming.GPU_RESOURCE] == 2
    assert spec["nodeSelector"] == {"pool": "a100"}
    assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"} in spec[
        "tolerations"
    ]
    args = objects[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--nproc-per-node") + 1] == "2"  # one process per GPU by default


@pytest.mark.parametrize(
    ("flags", "limit"),
    [
        (("--gpus-per-node", "2"), "2Gi"),
        ((), "1Gi"),
        (("--gpus-per-node", "2", "--shm-size", "12Gi"), "12Gi"),
    ],
    ids=["per-gpu", "cpu", "asked"],
)
def test_render_sizes_the_workers_shared_memory_by_gpus_or_as_asked(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], limit: str
) -> None:
    code, out, _ = run(capsys, "k8s", "render", "--image", IMAGE, *flags, *COMMAND)
    assert code == 0
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    template = yaml.safe_load(
        next(o for o in objects if o["kind"] == "ConfigMap")["data"][naming.TEMPLATE_KEY]
    )
    spec = template["spec"]
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": limit}
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "dshm"]
    assert mount["mountPath"] == "/dev/shm"


def test_render_runs_the_launcher_on_its_own_image(capsys: pytest.CaptureFixture[str]) -> None:
    # A GPU job's launcher needs no GPU: the CPU image spares a GPU image's pull (issue #20).
    flags = ("--image", "ea:1-gpu", "--gpus-per-node", "1", "--job-id", "g")
    code, out, _ = run(capsys, "k8s", "render", *flags, "--launcher-image", "ea:1", *COMMAND)
    assert code == 0
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    job = next(o for o in objects if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "ea:1"
    template = yaml.safe_load(
        next(o for o in objects if o["kind"] == "ConfigMap")["data"][naming.TEMPLATE_KEY]
    )
    assert template["spec"]["containers"][0]["image"] == "ea:1-gpu"
    code, out, err = run(capsys, "k8s", "render", *flags, "--launcher-image", "a b", *COMMAND)
    assert code == 2 and out == "" and "invalid --launcher-image 'a b'" in err


def test_render_with_a_tensorboard_dir_on_the_checkpoint_claim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = render_ok(
        capsys,
        "tb",
        *("--checkpoint-dir", "/checkpoints", "--checkpoint-claim", "team"),
        *("--tensorboard-dir", "/checkpoints/tensorboard/tb"),
    )
    args = launcher_args(out)
    assert args[args.index("--tensorboard-dir") + 1] == "/checkpoints/tensorboard/tb"
    parsed = _build_parser().parse_args(args)
    assert parsed.tensorboard_dir == "/checkpoints/tensorboard/tb"
    job = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "team"}} in pod["volumes"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in pod["containers"][0][
        "volumeMounts"
    ]
    # The claim itself is not created without --with-checkpoint-claim.
    assert "PersistentVolumeClaim" not in {d["kind"] for d in yaml.safe_load_all(out) if d}


def render_ok(capsys: pytest.CaptureFixture[str], job_id: str, *flags: str) -> str:
    """`k8s render` of job ``job_id`` with ``flags`` and the test command; its YAML (it must
    succeed without a word on stderr)."""
    code, out, err = run(
        capsys, "k8s", "render", "--image", IMAGE, "--job-id", job_id, *flags, *COMMAND
    )
    assert (code, err) == (0, ""), err
    return out


def launcher_args(out: str) -> list[str]:
    """The launcher Job's `elastic-run` arguments in rendered YAML."""
    job = [doc for doc in yaml.safe_load_all(out) if doc and doc["kind"] == "Job"][-1]
    return list(job["spec"]["template"]["spec"]["containers"][0]["args"])


def test_render_passes_every_job_option_to_the_launcher(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = render_ok(
        capsys,
        "opts",
        *("--workers", "3", "--max-workers", "6", "--gpus-per-node", "2", "--nproc-per-node", "1"),
        *("--max-restarts", "5", "--checkpoint-dir", "/ckpt", "--wait-timeout", "90"),
    )
    args = launcher_args(out)
    own = args[: args.index("--")]
    assert own[:2] == ["run", "--kubernetes"]
    for flag, value in [
        ("--max-restarts", "5"),
        ("--checkpoint-dir", "/ckpt"),
        ("--wait-timeout", "90"),
        ("--workers", "3"),
        ("--min-workers", "1"),
        ("--max-workers", "6"),
        ("--gpus-per-node", "2"),
        ("--nproc-per-node", "1"),
        ("--job-id", "opts"),
    ]:
        assert own[own.index(flag) + 1] == value, flag
    # The launcher's command line is `elastic-run run`'s: it parses back to the same job.
    parsed = _build_parser().parse_args(args)
    assert parsed.command == "run" and parsed.kubernetes
    assert job_options_from_args(parsed) == job_options(
        COMMAND[1:],
        job_id="opts",
        workers=3,
        max_workers=6,
        gpus_per_node=2,
        nproc_per_node=1,
        max_restarts=5,
        checkpoint_dir="/ckpt",
        wait_timeout=90,
    )


def job_flags_help(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    """The "job options" section of a command's --help."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(f"{GROUP_TITLE}:")
    section = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break
        section.append(line)
    return "\n".join(section).strip()


@pytest.mark.parametrize("action", ["render", "submit"])
def test_run_and_k8s_list_the_same_job_flags_from_one_definition(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    run_help = job_flags_help(capsys, "run")
    k8s_help = job_flags_help(capsys, "k8s", action)
    assert run_help == k8s_help
    for flag in (
        "--job-id",
        "--workers",
        "--min-workers",
        "--max-workers",
        "--nproc-per-node",
        "--gpus-per-node",
        "--max-restarts",
        "--wait-timeout",
        "--checkpoint-dir",
    ):
        assert f"{flag} " in run_help, flag
    assert "--gpus-per-worker" not in k8s_help  # one name per thing


def test_render_without_a_job_id_makes_one_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "k8s", "render", "--image", IMAGE, *COMMAND)
    assert code == 0
    job_id = err.split("job id ")[1].split()[0]
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    assert {o["metadata"]["labels"][naming.JOB_LABEL] for o in objects} == {job_id}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "-1"], "--workers (-1) must be 0 or more and --min-workers (1) at least 1"),
        (["--lease-ttl", "5"], "--stuck-timeout (5 s) must be longer than --lease-ttl (5 s)"),
        (["--stuck-timeout", "60"], "--resize-timeout (60 s) must be longer than --stuck-timeout"),
        (["--hang-timeout", "5"], "--hang-timeout must be 0 (no watchdog) or at least 10"),
        (["--min-workers", "3"], "need --min-workers <= --workers <= --max-workers"),
        (["--workers", "5", "--max-workers", "4"], "got 1 <= 5 <= 4"),
        (["--gpus-per-node", "1", "--nproc-per-node", "2"], "--nproc-per-node 2 needs"),
        (["--gpus-per-node", "-1"], "--gpus-per-node must be 0 or more"),
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
        (["--wait-timeout", "0"], "--wait-timeout must be a positive number of seconds"),
        (["--checkpoint-dir", "ckpt"], "invalid --checkpoint-dir 'ckpt': on Kubernetes"),
        (["--cpu", "lots"], "invalid --cpu 'lots'"),
        (["--memory", "2GB"], "invalid --memory '2GB'"),
        (["--job-id", "Bad_Name"], "invalid job id 'Bad_Name'"),
        (["--namespace", "Team A"], "invalid --namespace 'Team A'"),
        (["--etcd-replicas", "2"], "--etcd-replicas must be 1, 3 or 5"),
        (["--toleration", "gpu:Sometimes"], "invalid --toleration 'gpu:Sometimes'"),
        (["--node-selector", "pool"], "invalid --node-selector 'pool'"),
        (["--with-priority-class", "--priority-class", "other"], "--with-priority-class creates"),
        (["--with-checkpoint-claim"], "--with-checkpoint-claim creates the claim"),
        (["--checkpoint-dir", "/"], "invalid --checkpoint-dir '/'"),
        (["--checkpoint-dir", "/c", "--checkpoint-size", "lots"], "invalid --checkpoint-size"),
        (["--shm-size", "8GB"], "invalid --shm-size '8GB'"),
        (
            ["--checkpoint-dir", "/c", "--checkpoint-claim", "No_Claim"],
            "invalid --checkpoint-claim",
        ),
        (["--tensorboard-dir", "/tb"], "invalid --tensorboard-dir '/tb': on Kubernetes"),
        (["--checkpoint-dir", "/c", "--tensorboard-dir", "/tb"], "inside --checkpoint-dir /c"),
        (["--checkpoint-dir", "/c", "--tensorboard-dir", "/c"], "inside --checkpoint-dir /c"),
        (["--checkpoint-dir", "/c", "--tensorboard-dir", "tb"], "on Kubernetes the launcher"),
        (
            ["--job-id", "j", "--checkpoint-dir", "/c", "--tensorboard-dir", "/c/j/tb"],
            "/c/j holds the job's checkpoints",
        ),
        (["--api-server-cidr", "10.0.0.300/32"], "invalid --api-server-cidr '10.0.0.300/32'"),
    ],
)
def test_bad_flags_give_one_clear_error(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, out, err = run(capsys, "k8s", "render", "--image", IMAGE, *flags, *COMMAND)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("elastic-run k8s render: error: ")
    assert message in lines[0]


def test_no_training_command_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "k8s", "render", "--image", IMAGE)
    assert (code, out) == (2, "")
    assert "no training command: give it after `--`" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--etcd", "e:2379", "--with-etcd"],
        ["--priority-class", "x", "--no-priority-class"],
        ["--workers", "two"],
    ],
)
def test_conflicting_or_malformed_flags_are_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["k8s", "render", "--image", IMAGE, *flags, *COMMAND])
    assert exited.value.code == 2
    assert "error: argument" in capsys.readouterr().err


# -- submit ------------------------------------------------------------------------------------


#: The flags that make `submit` create every shared object too.
EVERYTHING = (
    "--with-etcd",
    "--with-priority-class",
    "--with-admission-policy",
    "--launcher-pdb",
    *("--checkpoint-dir", "/checkpoints", "--with-checkpoint-claim"),
)


def test_submit_creates_every_object_render_prints(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    code, out, err = submit(capsys, kubeconfig, *EVERYTHING)
    assert (code, err) == (0, ""), err
    spec = manifests.JobSpec(
        image=IMAGE,
        job=job_options(COMMAND[1:], job_id="demo", checkpoint_dir="/checkpoints"),
        namespace=NS,
        with_etcd=True,
        with_priority_class=True,
        with_admission_policy=True,
        with_checkpoint_claim=True,
        launcher_disruption_budget=True,
    )
    kinds = [o["kind"] for o in manifests.render(spec)]
    assert {"PersistentVolumeClaim", "ValidatingAdmissionPolicy", "PodDisruptionBudget"} <= set(
        kinds
    )
    assert kinds.count("PriorityClass") == 2
    for manifest in manifests.render(spec):
        kind = KINDS[manifest["kind"]]
        namespace = manifest["metadata"].get("namespace")
        stored = kube.get(kind, manifest["metadata"]["name"], namespace)
        assert stored is not None, manifest["metadata"]["name"]
        for field in set(manifest) - {"metadata", "apiVersion", "kind"}:
            assert stored[field] == manifest[field], (manifest["kind"], field)
        assert stored["metadata"]["labels"] == manifest["metadata"]["labels"]
        assert f"{manifest['kind']}/{manifest['metadata']['name']}: created" in out
    assert "elastic-run k8s status --namespace ml --job-id demo" in out


def test_a_second_submit_of_the_same_job_is_refused_before_anything_changes(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, fake: FakeKube
) -> None:
    assert submit(capsys, kubeconfig, "--with-etcd", "--with-priority-class")[0] == 0
    writes_before = [req for req in fake.requests if req[0] != "GET"]
    code, out, err = submit(capsys, kubeconfig, "--with-etcd", "--with-priority-class")
    assert (code, out) == (3, "")  # a conflict with the cluster's state: operational
    assert "job 'demo' already exists in namespace 'ml'" in err
    assert "elastic-run k8s delete --namespace ml --job-id demo" in err
    assert [req for req in fake.requests if req[0] != "GET"] == writes_before


def test_submit_replaces_what_a_deleted_job_left_and_keeps_shared_objects(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    assert submit(capsys, kubeconfig, *EVERYTHING)[0] == 0
    kube.delete(KINDS["Job"], "demo-launcher", NS)
    code, out, err = submit(capsys, kubeconfig, *EVERYTHING, "--cpu", "3")
    assert (code, err) == (0, "")
    assert "ConfigMap/demo-worker-template: replaced" in out
    assert "StatefulSet/elastic-allreduce-etcd: exists, kept" in out
    assert "PriorityClass/elastic-allreduce-preemptible: exists, kept" in out
    assert "PersistentVolumeClaim/elastic-allreduce-checkpoints: exists, kept" in out
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        assert f"{kind}/elastic-allreduce-launcher-pods: exists, kept" in out
    assert "Job/demo-launcher: created" in out
    config_map = kube.get(KINDS["ConfigMap"], "demo-worker-template", NS)
    assert config_map is not None
    template = yaml.safe_load(config_map["data"][naming.TEMPLATE_KEY])
    assert template["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "3"


def test_submit_without_an_etcd_in_the_namespace_says_how_to_get_one(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, fake: FakeKube
) -> None:
    code, _, err = submit(capsys, kubeconfig, "--no-priority-class")
    assert code == 2
    assert "namespace 'ml' has no etcd (Service elastic-allreduce-etcd not found)" in err
    assert "--with-etcd" in err
    assert [req for req in fake.requests if req[0] != "GET"] == []


def test_submit_needs_the_priority_class_to_exist(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    code, _, err = submit(capsys, kubeconfig, "--with-etcd")
    assert code == 2
    assert "PriorityClass 'elastic-allreduce-preemptible' does not exist" in err
    assert names(kube, "Job") == set()
    assert submit(capsys, kubeconfig, "--with-etcd", "--no-priority-class")[0] == 0
    config_map = kube.get(KINDS["ConfigMap"], "demo-worker-template", NS)
    assert config_map is not None
    assert (
        "priorityClassName" not in yaml.safe_load(config_map["data"][naming.TEMPLATE_KEY])["spec"]
    )


def test_submit_needs_the_launchers_priority_class_too(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    kube.create(manifests.priority_class())  # the workers' only
    code, _, err = submit(capsys, kubeconfig, "--with-etcd")
    assert code == 2
    assert "PriorityClass 'elastic-allreduce-launcher' does not exist" in err
    assert "no launcher pod could be created" in err
    assert names(kube, "Job") == set()
    code, _, err = submit(capsys, kubeconfig, "--with-etcd", "--launcher-priority-class", "prod")
    assert code == 2 and "PriorityClass 'prod' does not exist" in err
    kube.create({**manifests.launcher_priority_class(), "metadata": {"name": "prod"}})
    assert submit(capsys, kubeconfig, "--with-etcd", "--launcher-priority-class", "prod")[0] == 0
    job = kube.get(KINDS["Job"], "demo-launcher", NS)
    assert job is not None
    assert job["spec"]["template"]["spec"]["priorityClassName"] == "prod"


def test_render_gives_the_launcher_its_priority_class_and_a_budget_only_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def render(*extra: str) -> list[dict[str, Any]]:
        code, out, err = run(capsys, "k8s", "render", "--image", IMAGE, *extra, *COMMAND)
        assert code == 0, err
        return [doc for doc in yaml.safe_load_all(out) if doc]

    def launcher_class(objects: list[dict[str, Any]]) -> str | None:
        [job] = [o for o in objects if o["kind"] == "Job"]
        return job["spec"]["template"]["spec"].get("priorityClassName")

    plain = render()
    assert launcher_class(plain) == naming.LAUNCHER_PRIORITY_CLASS
    assert not [o for o in plain if o["kind"] == "PodDisruptionBudget"]
    assert launcher_class(render("--launcher-priority-class", "prod")) == "prod"
    assert launcher_class(render("--no-priority-class")) is None
    [budget] = [o for o in render("--launcher-pdb") if o["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["minAvailable"] == 1
    code, _, err = run(
        capsys,
        "k8s",
        "render",
        "--image",
        IMAGE,
        "--with-priority-class",
        "--launcher-priority-class",
        "prod",
        *COMMAND,
    )
    assert code == 2 and "--with-priority-class creates 'elastic-allreduce-launcher'" in err


def test_delete_without_rights_on_disruption_budgets_still_deletes_the_job(
    capsys: pytest.CaptureFixture[str], fake: FakeKube, kubeconfig: str
) -> None:
    assert submit(capsys, kubeconfig, "--with-etcd", "--no-priority-class")[0] == 0
    fake.deny("list", "poddisruptionbudgets")  # an older submitter's Role
    code, out, err = run(
        capsys, "k8s", "delete", "--kubeconfig", kubeconfig, "--namespace", NS, "--job-id", "demo"
    )
    assert code == 0, err
    assert "Job/demo-launcher: deleted" in out
    assert "warning: not checked" in err and "poddisruptionbudgets" in err


def test_submit_to_a_missing_namespace_says_to_create_it(
    capsys: pytest.CaptureFixture[str], kubeconfig: str
) -> None:
    code, _, err = submit(
        capsys,
        kubeconfig,
        *("--etcd", "etcd.infra:2379", "--no-priority-class"),
        namespace="nope",
    )
    assert code == 2
    assert "namespace 'nope' does not exist: create it (`kubectl create namespace nope`)" in err


def test_a_forbidden_verb_is_a_clear_rbac_error_with_exit_code_3(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, fake: FakeKube
) -> None:
    fake.deny("create", "roles")
    code, out, err = submit(
        capsys, kubeconfig, "--with-etcd", "--with-priority-class", "--with-admission-policy"
    )
    assert code == 3
    [line] = err.strip().splitlines()
    assert line.startswith(
        "elastic-run k8s submit: error: forbidden: the Kubernetes API refused to create roles "
        "in namespace 'ml': roles is forbidden: User"
    )
    assert "allows create on roles in namespace 'ml'" in line
    assert "ServiceAccount/demo-launcher: created" in out


def test_submit_warns_when_the_cluster_has_no_admission_policy(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, fake: FakeKube
) -> None:
    code, _, err = submit(capsys, kubeconfig, "--with-etcd", "--with-priority-class")
    assert code == 0
    [line] = err.strip().splitlines()
    assert line.startswith(
        "elastic-run k8s submit: warning: the cluster has no ValidatingAdmissionPolicy "
        "'elastic-allreduce-launcher-pods': the launcher may create any pod its Role allows"
    )
    assert "k8s/cluster/admission-policy.yaml" in line


def test_submit_needs_the_checkpoint_claim_to_exist(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    flags = ("--with-etcd", "--no-priority-class", "--with-admission-policy")
    code, _, err = submit(capsys, kubeconfig, *flags, "--checkpoint-dir", "/checkpoints")
    assert code == 2
    assert (
        "PersistentVolumeClaim 'elastic-allreduce-checkpoints' does not exist in namespace" in err
    )
    assert "--with-checkpoint-claim" in err
    assert names(kube, "Job") == set()
    claim = manifests.checkpoint_claim()
    claim["metadata"]["namespace"] = NS
    kube.create(claim)
    code, out, err = submit(capsys, kubeconfig, *flags, "--checkpoint-dir", "/checkpoints")
    assert (code, err) == (0, ""), err
    assert "PersistentVolumeClaim" not in out  # an existing claim is used, not created


def test_an_unchecked_prerequisite_is_a_warning_not_an_error(
    capsys: pytest.CaptureFixture[str], kubeconfig: str
) -> None:
    # Submitters without cluster-wide rights often cannot read PriorityClasses.
    with FakeKube(namespaces=(NS,)) as other:
        other.deny("get", "priorityclasses")
        config = write_kubeconfig(Path(kubeconfig).with_name("other"), other.url)
        code, _, err = submit(capsys, str(config), "--with-etcd")
    assert code == 0
    assert "warning: not checked: forbidden" in err


# -- status and delete -------------------------------------------------------------------------


def add_pod(kube: Kube, name: str, role: str, phase: str, **status: Any) -> None:
    labels = {**naming.job_labels("demo"), naming.ROLE_LABEL: role}
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": IMAGE}], "nodeName": "node-1"},
        }
    )
    stored = kube.get(KINDS["Pod"], name, NS)
    assert stored is not None
    stored["status"] = {"phase": phase, "podIP": "10.0.0.7", **status}
    kube.request("PUT", KINDS["Pod"], NS, f"{name}/status", body=stored)


def test_status_shows_the_launcher_and_the_workers(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    assert submit(capsys, kubeconfig, "--with-etcd", "--with-priority-class")[0] == 0
    add_pod(kube, "demo-launcher-x1", "launcher", "Running")
    add_pod(kube, "demo-worker-1", "worker", "Running")
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
    add_pod(kube, "demo-worker-2", "worker", "Pending", conditions=[unschedulable])
    code, out, err = run(
        capsys, "k8s", "status", "--kubeconfig", kubeconfig, "--namespace", NS, "--job-id", "demo"
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "job demo in namespace ml: starting"
    assert "launcher" in lines[1] and "demo-launcher-x1" in lines[1] and "Running" in lines[1]
    assert "demo-worker-1" in lines[2] and "Running" in lines[2] and "10.0.0.7" in lines[2]
    assert "demo-worker-2" in lines[3] and "Insufficient nvidia.com/gpu" in lines[3]
    assert lines[-1] == "workers: 1 pending, 1 running"


def test_status_of_a_finished_job(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    assert submit(capsys, kubeconfig, "--with-etcd", "--with-priority-class")[0] == 0
    job = kube.get(KINDS["Job"], "demo-launcher", NS)
    assert job is not None
    job["status"] = {
        "failed": 1,
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"},
        ],
    }
    kube.request("PUT", KINDS["Job"], NS, "demo-launcher/status", body=job)
    code, out, _ = run(
        capsys, "k8s", "status", "--kubeconfig", kubeconfig, "--namespace", NS, "--job-id", "demo"
    )
    assert code == 0
    assert out.splitlines()[0] == "job demo in namespace ml: failed: BackoffLimitExceeded"


def test_status_of_an_unknown_job_is_an_error(
    capsys: pytest.CaptureFixture[str], kubeconfig: str
) -> None:
    code, out, err = run(
        capsys, "k8s", "status", "--kubeconfig", kubeconfig, "--namespace", NS, "--job-id", "ghost"
    )
    assert (code, out) == (2, "")
    assert "no job 'ghost' in namespace 'ml'" in err


def test_delete_removes_the_jobs_objects_and_pods_and_keeps_the_shared_ones(
    capsys: pytest.CaptureFixture[str], kubeconfig: str, kube: Kube
) -> None:
    assert submit(capsys, kubeconfig, *EVERYTHING)[0] == 0
    add_pod(kube, "demo-worker-1", "worker", "Running")
    other = manifests.JobSpec(
        image=IMAGE, job=job_options(("python", "x.py"), job_id="other"), namespace=NS
    )
    for manifest in manifests.render(other):
        kube.create(manifest)
    code, out, err = run(
        capsys, "k8s", "delete", "--kubeconfig", kubeconfig, "--namespace", NS, "--job-id", "demo"
    )
    assert (code, err) == (0, ""), err
    assert "Pod/demo-worker-1: deleted" in out
    selector = naming.job_selector("demo")
    for kind in (*JOB_KINDS, "Pod"):
        remaining = kube.list(KINDS[kind], NS, selector)
        # A pod with a grace period is Terminating until its kubelet confirms; none runs here.
        assert [o["metadata"]["name"] for o in remaining if kind != "Pod"] == []
    assert names(kube, "StatefulSet") == {"elastic-allreduce-etcd"}
    assert names(kube, "Service") == {"elastic-allreduce-etcd", "elastic-allreduce-etcd-peer"}
    assert names(kube, "Job") == {"other-launcher"}
    # The checkpoints stay, and so does the cluster's admission policy.
    assert names(kube, "PersistentVolumeClaim") == {"elastic-allreduce-checkpoints"}
    assert names(kube, "ValidatingAdmissionPolicy", None) == {"elastic-allreduce-launcher-pods"}
    assert "ServiceAccount/demo-worker: deleted" in out
    code, _, err = run(
        capsys, "k8s", "delete", "--kubeconfig", kubeconfig, "--namespace", NS, "--job-id", "demo"
    )
    assert code == 2
    assert "nothing to delete: no objects labelled elastic-allreduce/job=demo" in err


def test_delete_needs_a_job_id(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["k8s", "delete", "--namespace", NS])
    assert exited.value.code == 2
    assert "--job-id" in capsys.readouterr().err


# -- no cluster ----------------------------------------------------------------------------------


def test_an_unreachable_cluster_is_a_clear_operational_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = write_kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
    code, out, err = run(
        capsys, "k8s", "status", "--kubeconfig", str(config), "--namespace", NS, "--job-id", "x"
    )
    assert (code, out) == (3, "")
    assert f"cannot reach the Kubernetes API at http://127.0.0.1:{port} to get jobs" in err
    assert "kubectl cluster-info" in err


def test_no_cluster_configuration_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    code, _, err = run(capsys, "k8s", "delete", "--namespace", NS, "--job-id", "x")
    assert code == 2
    assert f"no usable Kubernetes cluster configuration in {tmp_path / 'missing'}" in err
    assert "Point --kubeconfig or KUBECONFIG at a kubeconfig file" in err


def test_inside_a_pod_without_a_service_account_token_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    code, _, err = run(capsys, "k8s", "status", "--namespace", NS, "--job-id", "x")
    assert code == 2
    assert "inside a pod, but its service account cannot be used" in err
