"""Build the project's patched Horovod against the TensorFlow of a Python environment.

Horovod's last release (0.28.1, June 2023) predates TensorFlow 2.16 and Keras 3. This project
keeps it working with its own patch set (``patches/*.patch``, each saying why), applied to the
pinned sdist (its SHA-256 checked) before the build. A built wheel is cached per Horovod
version, TensorFlow version, Python version, GPU operations and patch set, so a wheel built for
one TensorFlow is never installed beside another (Horovod refuses that at import with
``HorovodVersionMismatchError``), and a second environment with the same stack installs in
seconds. ``python -m elastic_allreduce.horovod_build`` is the command (``--help``); ``make
setup`` and the Dockerfiles call it. It imports neither TensorFlow nor Horovod itself: it asks
the target interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic_allreduce.errors import ConfigError

HOROVOD_VERSION = "0.28.1"
#: The sdist on PyPI that the patches are made for.
SDIST_NAME = f"horovod-{HOROVOD_VERSION}.tar.gz"
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
PATCHES = Path(__file__).resolve().parent / "patches"
#: Written into the installed ``horovod`` package: which build it is (the cache key).
MARKER = "ELASTIC_ALLREDUCE_BUILD"

#: The target interpreter's TensorFlow and Python versions, and whether CUDA is in reach.
_PROBE = r"""
import json, os, shutil, sys
try:
    import tensorflow as tf
    tf_version = tf.__version__
except ImportError:
    tf_version = None
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2],
    "tensorflow": tf_version,
    "cuda": bool(shutil.which("nvcc") or os.environ.get("HOROVOD_CUDA_HOME")),
}))
"""

#: The installed Horovod's build key, if it was built here and imports with Gloo (argv[1]: the
#: marker's file name).
_INSTALLED = r"""
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("horovod")
if spec is None or spec.origin is None:
    sys.exit(1)
marker = pathlib.Path(spec.origin).parent / sys.argv[1]
import horovod.tensorflow as hvd
if not hvd.gloo_built():
    sys.exit(1)
print(marker.read_text().strip() if marker.is_file() else "")
"""


class BuildError(ConfigError):
    """The build could not be done; the message says what is missing and what to do."""


@dataclass(frozen=True)
class Target:
    """The environment a wheel is built for (what makes two wheels interchangeable)."""

    python: str
    tensorflow: str
    gpu: bool

    def key(self) -> str:
        ops = "nccl" if self.gpu else "cpu"
        py = self.python.replace(".", "")
        return f"horovod-{HOROVOD_VERSION}-tf{self.tensorflow}-py{py}-{ops}-{patch_digest()[:12]}"


def patch_digest() -> str:
    """SHA-256 over the patch files' names and contents: a changed patch is a new build."""
    digest = hashlib.sha256()
    for patch in patch_files():
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()


def patch_files() -> list[Path]:
    """The patch set, in the order it is applied."""
    return sorted(PATCHES.glob("*.patch"))


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elastic-allreduce" / "horovod"


def probe(python: str, gpu: str) -> Target:
    """The target interpreter's stack; BuildError without TensorFlow there."""
    try:
        found = subprocess.run(
            [python, "-c", _PROBE], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise BuildError(f"cannot run {python}: {error}") from error
    facts = json.loads(found.strip().splitlines()[-1])
    if facts["tensorflow"] is None:
        raise BuildError(
            f"{python} has no TensorFlow: install it first (for example `{python} -m pip "
            f"install tensorflow-cpu`), then build Horovod against it"
        )
    use_gpu = facts["cuda"] if gpu == "auto" else gpu == "nccl"
    return Target(python=facts["python"], tensorflow=facts["tensorflow"], gpu=use_gpu)


def installed_key(python: str) -> str | None:
    """The build key of the Horovod installed for ``python`` (empty: not built here), or None
    when there is none that imports with TensorFlow and Gloo."""
    result = subprocess.run(
        [python, "-c", _INSTALLED, MARKER], check=False, capture_output=True, text=True
    )
    if result.returncode != 0:
        return None
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def fetch_sdist(python: str, cache: Path, sdist: Path | None) -> Path:
    """The pinned sdist: the one given, else the cached one, else downloaded by pip."""
    if sdist is None:
        sdist = cache / "sdist" / SDIST_NAME
        if not sdist.is_file():
            sdist.parent.mkdir(parents=True, exist_ok=True)
            _run(
                [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                 "--no-deps", "--no-binary", ":all:", f"horovod=={HOROVOD_VERSION}",
                 "-d", str(sdist.parent)],
                what="download Horovod's sdist (or pass --sdist FILE)",
            )  # fmt: skip
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BuildError(
            f"{sdist} is not Horovod {HOROVOD_VERSION}'s sdist (SHA-256 {digest}, expected "
            f"{SDIST_SHA256}): remove it, or pass the right file with --sdist"
        )
    return sdist


def apply_patches(source: Path) -> None:
    """Apply the patch set to an unpacked sdist (GNU patch, all or nothing per file)."""
    tool = shutil.which("patch")
    if tool is None:
        raise BuildError("the build needs GNU patch on PATH (Debian: apt-get install patch)")
    for patch in patch_files():
        _run(
            [tool, "-p1", "--forward", "--batch", "--silent", "-d", str(source), "-i", str(patch)],
            what=f"apply {patch.name} to {source.name}",
        )


def build_wheel(target: Target, python: str, sdist: Path, into: Path) -> Path:
    """Unpack, patch and build; the wheel, moved into ``into``."""
    if shutil.which("cmake") is None:
        raise BuildError("the build needs cmake on PATH (pip install 'cmake<4', or apt)")
    with tempfile.TemporaryDirectory(prefix="hvd-build-") as work:
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = Path(work) / f"horovod-{HOROVOD_VERSION}"
        apply_patches(source)
        env = dict(os.environ)
        env.update(
            HOROVOD_WITH_TENSORFLOW="1",
            HOROVOD_WITH_GLOO="1",
            HOROVOD_WITHOUT_MPI="1",
            HOROVOD_WITHOUT_PYTORCH="1",
            HOROVOD_WITHOUT_MXNET="1",
            # CMake 4 refuses the bundled Gloo's cmake_minimum_required(2.8.12) without it.
            CMAKE_POLICY_VERSION_MINIMUM=env.get("CMAKE_POLICY_VERSION_MINIMUM", "3.5"),
            MAKEFLAGS=env.get("MAKEFLAGS", f"-j{os.cpu_count() or 2}"),
            # GCC >= 13 no longer includes these through other headers; Horovod assumes it.
            CXXFLAGS=f"{env.get('CXXFLAGS', '')} -include cstdint -include string "
            "-include stdexcept".strip(),
        )
        if target.gpu:
            env.setdefault("HOROVOD_GPU_OPERATIONS", "NCCL")
            env.setdefault("HOROVOD_NCCL_LINK", "SHARED")
        # The interpreter's own bin first: its cmake (if pip installed one) and its Python.
        env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
        wheels = Path(work) / "wheels"
        _run(
            [python, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
             "--no-build-isolation", "--no-deps", str(source), "-w", str(wheels)],
            what=f"build Horovod {HOROVOD_VERSION} against TensorFlow {target.tensorflow}",
            env=env,
        )  # fmt: skip
        (built,) = wheels.glob("horovod-*.whl")
        into.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(built, into / built.name))


def ensure(
    python: str,
    *,
    cache: Path,
    sdist: Path | None = None,
    gpu: str = "auto",
    say: Callable[[str], object] = print,
) -> str:
    """Install the patched Horovod built for ``python``'s TensorFlow (building it once per
    stack); what was done, in words."""
    target = probe(python, gpu)
    key = target.key()
    if installed_key(python) == key:
        return f"{key} is installed"
    folder = cache / key
    wheels = sorted(folder.glob("horovod-*.whl"))
    if wheels:
        wheel, how = wheels[0], "from the cache"
    else:
        say(f"building {key} (a few minutes the first time; cached in {folder})")
        wheel, how = build_wheel(target, python, fetch_sdist(python, cache, sdist), folder), "built"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    _run([*pip, "uninstall", "--yes", "horovod"], what="remove the installed Horovod")
    _run([*pip, "install", str(wheel)], what=f"install {wheel.name}")
    site = subprocess.run(
        [python, "-c", "import horovod, pathlib; print(pathlib.Path(horovod.__file__).parent)"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / MARKER).write_text(key + "\n")
    if installed_key(python) != key:
        raise BuildError(f"{wheel} installed but horovod.tensorflow does not import with Gloo")
    return f"{key} {how} and installed"


def _run(command: list[str], *, what: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(command, env=env, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-40:])
        raise BuildError(f"could not {what} (exit {result.returncode}):\n{tail}")


def main(argv: list[str] | None = None) -> int:
    import argparse  # noqa: PLC0415 - only the command needs it

    parser = argparse.ArgumentParser(
        prog="python -m elastic_allreduce.horovod_build",
        description=(
            f"Build Horovod {HOROVOD_VERSION} with this project's patches against the "
            "TensorFlow installed for PYTHON, with Gloo (and NCCL where CUDA is found), and "
            "install it there. Built wheels are cached per stack; a second call for the same "
            "stack returns at once."
        ),
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the environment's interpreter (default: this)"
    )
    parser.add_argument(
        "--cache", type=Path, default=default_cache(), help="wheel cache (default: %(default)s)"
    )
    parser.add_argument(
        "--sdist", type=Path, help=f"{SDIST_NAME} to use instead of downloading it with pip"
    )
    parser.add_argument(
        "--gpu",
        choices=("auto", "cpu", "nccl"),
        default="auto",
        help="GPU operations: NCCL when nvcc or HOROVOD_CUDA_HOME is found (auto), or say so",
    )
    args = parser.parse_args(argv)
    try:
        done = ensure(args.python, cache=args.cache, sdist=args.sdist, gpu=args.gpu)
    except BuildError as error:
        print(f"horovod_build: error: {error}", file=sys.stderr)
        return 2
    print(f"horovod_build: {done}")
    return 0
