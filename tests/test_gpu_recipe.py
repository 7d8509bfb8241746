"""The GPU recipe, checked without building anything (issue #20, item 5): Dockerfile.gpu installs
no held package (NCCL, cuDNN) without a pinned version and the flag that lets apt change a hold,
gives the runtime stage libdevice and ptxas where XLA looks for them, and pins its base images
by digest or says they are not pinned; the GPU worker template carries NCCL's socket interface,
TensorFlow's memory growth and a /dev/shm size limit; the GPU example waits for a cold cluster.
Each of these was a defect that would have stopped the first real GPU run (docs/gpu.md)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher import job_options
from launcher.k8s import manifests as m
from tests.conftest import ROOT
from tests.test_dockerfiles import base_images, instructions

DOCKERFILE = "Dockerfile.gpu"
GPU_EXAMPLE = ROOT / "k8s" / "overlays" / "gpu-example"
#: Packages NVIDIA's CUDA images hold at the version they ship (apt-mark hold).
HELD = re.compile(r"^(libnccl2|libnccl-dev|libcudnn\S*)$")
VERSION = re.compile(r"^[0-9][A-Za-z0-9.+~:-]*$")


def global_args(name: str = DOCKERFILE) -> dict[str, str]:
    """The ARG defaults declared before the first FROM."""
    defaults = {}
    for keyword, rest in instructions(name):
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            defaults[key] = value
    return defaults


def expand(text: str, args: dict[str, str]) -> str:
    """``text`` with ``${NAME}`` and ``$NAME`` of ``args`` substituted, quotes dropped."""
    for key, value in args.items():
        text = text.replace("${" + key + "}", value)
        text = re.sub(rf"\${key}\b", value, text)
    return text.replace('"', "").replace("'", "")


def stages(name: str = DOCKERFILE) -> list[list[tuple[str, str]]]:
    """The instructions of each stage (each starting with its FROM)."""
    result: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions(name):
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, rest))
    return result


def apt_installs(stage: list[tuple[str, str]]) -> list[list[str]]:
    """The words of every `apt-get install` command of a stage's RUN instructions, expanded."""
    args = global_args()
    commands = []
    for keyword, rest in stage:
        if keyword != "RUN":
            continue
        for command in re.split(r"&&|;|\|\|", expand(rest, args)):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                commands.append(words)
    return commands


def held_packages(stage: list[tuple[str, str]]) -> dict[str, tuple[str, bool]]:
    """Held packages a stage installs: name -> (version given, whether a hold may change)."""
    found = {}
    for words in apt_installs(stage):
        for word in words[2:]:
            name, _, version = word.partition("=")
            if not word.startswith("-") and HELD.match(name):
                found[name] = (version, "--allow-change-held-packages" in words)
    return found


def test_held_packages_are_installed_at_a_pinned_version_that_may_change_the_hold() -> None:
    build, runtime = stages()
    for stage in (build, runtime):
        for name, (version, allowed) in held_packages(stage).items():
            # By name alone apt takes the repository's newer version and refuses to replace
            # the held one: "Held packages were changed and -y was used without --allow-...".
            assert VERSION.match(version), f"{DOCKERFILE} installs held {name} without a version"
            assert allowed, (
                f"{DOCKERFILE} installs held {name} without --allow-change-held-packages"
            )
    built, shipped = held_packages(build), held_packages(runtime)
    assert {"libnccl2", "libnccl-dev"} <= set(built)
    # Horovod is linked against the build stage's NCCL: the runtime stage must have the same.
    assert shipped["libnccl2"][0] == built["libnccl2"][0] == built["libnccl-dev"][0]


def test_the_held_package_check_catches_a_package_named_without_its_version() -> None:
    stage = [("RUN", "apt-get update && apt-get install -y --no-install-recommends libnccl-dev")]
    assert held_packages(stage) == {"libnccl-dev": ("", False)}
    assert not VERSION.match(held_packages(stage)["libnccl-dev"][0])


def test_the_runtime_stage_has_libdevice_and_ptxas_where_xla_looks() -> None:
    runtime = stages()[-1]
    args = {**global_args()}
    copied = [
        expand(rest, args).split()[-1]
        for keyword, rest in runtime
        if keyword == "COPY" and rest.startswith("--from=build")
    ]
    nvcc = any(w.startswith("cuda-nvcc") for words in apt_installs(runtime) for w in words)
    libdevice = [path for path in copied if path.endswith("/nvvm/libdevice")]
    ptxas = [path for path in copied if path.endswith("/bin/ptxas")]
    # TensorFlow 2.15's Keras optimizers jit-compile on GPU: XLA needs both at run time.
    assert nvcc or (libdevice and ptxas), "the runtime stage has no libdevice and ptxas"
    if not nvcc:
        cuda_dir = libdevice[0].removesuffix("/nvvm/libdevice")
        assert ptxas == [f"{cuda_dir}/bin/ptxas"]
        environment = " ".join(expand(rest, args) for keyword, rest in runtime if keyword == "ENV")
        assert f"XLA_FLAGS=--xla_gpu_cuda_data_dir={cuda_dir}" in environment.split()
        # ... and the build fails if either is missing.
        checks = " ".join(expand(rest, args) for keyword, rest in runtime if keyword == "RUN")
        assert f"{cuda_dir}/nvvm/libdevice/libdevice.10.bc" in checks
        assert f"{cuda_dir}/bin/ptxas --version" in checks


def test_base_images_are_pinned_by_digest_or_listed_as_not_pinned_yet() -> None:
    docs = (ROOT / "docs" / "gpu.md").read_text()
    for image in base_images(DOCKERFILE):
        tag, at, digest = image.partition("@")
        if at:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), image
        else:
            said = [line for line in docs.splitlines() if f"`{tag}`" in line]
            assert any("not pinned yet" in line.lower() for line in said), (
                f"{tag} is not pinned by digest and docs/gpu.md does not say so"
            )


def _gpu_spec(gpus: int) -> m.JobSpec:
    return m.JobSpec(
        image="registry.example.com/ea:1-gpu",
        launcher_image="registry.example.com/ea:1",
        job=job_options.job_options(("python", "train.py"), job_id="g", gpus_per_node=gpus),
        memory="16Gi",
    )


def _templates() -> dict[str, Any]:
    text = (GPU_EXAMPLE / "worker-pod.yaml").read_text()
    return {
        "k8s/overlays/gpu-example": yaml.safe_load(text),
        "render --gpus-per-node 1": m.worker_pod(_gpu_spec(1)),
        "render --gpus-per-node 8": m.worker_pod(_gpu_spec(8)),
    }


def _gibibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    return float(number) * {"Gi": 1, "Mi": 1 / 1024, "Ti": 1024}[unit]


@pytest.mark.parametrize("source", list(_templates()))
def test_the_gpu_worker_template_carries_the_nccl_and_tensorflow_settings(source: str) -> None:
    template = _templates()[source]
    [container] = template["spec"]["containers"]
    variables = {e["name"]: e.get("value") for e in container["env"]}
    # NCCL's sockets on the pod network, as Gloo's: NCCL's own pick may be unreachable.
    assert variables["NCCL_SOCKET_IFNAME"] == variables["ELASTIC_ALLREDUCE_GLOO_IFACE"] == "eth0"
    # TensorFlow must leave NCCL room for the communicators re-created after each reset.
    assert variables["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    # The device plugin sets it to the pod's GPUs; a value here would override that.
    assert "NVIDIA_VISIBLE_DEVICES" not in variables
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    shm = volumes["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    memory = _gibibytes(container["resources"]["limits"]["memory"])
    # A limit, of at least 1 GiB per GPU and within the pod's memory (its pages count there).
    assert gpus <= _gibibytes(shm["sizeLimit"]) < memory


def test_the_launcher_is_given_no_gpu_and_may_run_the_cpu_image() -> None:
    objects = m.render(_gpu_spec(4))
    [job] = [o for o in objects if o["kind"] == "Job"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/ea:1"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    # Without --launcher-image the launcher runs --image, as before.
    plain = m.render(m.JobSpec(image="ea:2", job=job_options.job_options(("python", "t.py"))))
    [job] = [o for o in plain if o["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "ea:2"


def test_the_gpu_example_waits_long_enough_for_a_cold_gpu_cluster() -> None:
    kustomization = yaml.safe_load((GPU_EXAMPLE / "kustomization.yaml").read_text())
    [patch] = [p for p in kustomization["patches"] if p["target"]["kind"] == "Job"]
    [operation] = yaml.safe_load(patch["patch"])
    args = operation["value"]
    # New GPU nodes from the autoscaler plus a GPU image of several GB: minutes, not seconds.
    assert float(args[args.index("--wait-timeout") + 1]) >= 900


def test_pin_base_images_writes_the_digest_the_registry_gives(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.2.2-devel-ubuntu22.04\n"
        f"ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.2.2-runtime-ubuntu22.04@sha256:{'0' * 64}\n"
        "FROM ${CUDA_DEVEL_IMAGE}\n"
    )
    resolver = tmp_path / "resolve"
    resolver.write_text(f"#!/bin/sh\necho sha256:{'a' * 64}\n")
    resolver.chmod(0o755)
    script = str(ROOT / "scripts" / "pin-base-images.sh")
    environ = {**os.environ, "DIGEST_RESOLVER": str(resolver)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, *args, str(dockerfile)],
            env=environ,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    checked = run("--check")
    assert checked.returncode == 1
    assert "CUDA_DEVEL_IMAGE=nvidia/cuda:12.2.2-devel-ubuntu22.04 is not pinned" in checked.stdout
    assert "has moved to sha256:" + "a" * 64 in checked.stdout
    assert run().returncode == 0
    assert dockerfile.read_text().splitlines()[:2] == [
        f"ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.2.2-devel-ubuntu22.04@sha256:{'a' * 64}",
        f"ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.2.2-runtime-ubuntu22.04@sha256:{'a' * 64}",
    ]
    assert run("--check").returncode == 0
