"""The project's Horovod patch set and its builder (issue #41): every patch says why and applies
to the pinned sdist; the Horovod installed here is the build for this stack (not a stale wheel
from another TensorFlow); wrong input gets one clear error.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from elastic_allreduce import horovod_build
from elastic_allreduce.horovod_build import BuildError, Target


def test_every_patch_opens_with_why_it_exists() -> None:
    patches = horovod_build.patch_files()
    assert [p.name[:4] for p in patches] == ["0001", "0002", "0003"]
    for patch in patches:
        text = patch.read_text()
        assert text.startswith("Why: "), patch.name
        assert text.index("--- a/") > 200, f"{patch.name}: say why in a paragraph"


def test_the_patch_set_applies_to_the_pinned_sdist(tmp_path: Path) -> None:
    """Applied by the builder's own code to a fresh copy of the sdist (downloaded once into
    the builder's cache, checked by its SHA-256); each patch changes what it says it does."""
    sdist = horovod_build.fetch_sdist(sys.executable, horovod_build.default_cache(), None)
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    source = tmp_path / f"horovod-{horovod_build.HOROVOD_VERSION}"
    horovod_build.apply_patches(source)
    xla = (source / "horovod/tensorflow/xla_mpi_ops.cc").read_text()
    assert "TENSORFLOW_VERSION < 2016000000 && HAVE_GPU" in xla
    keras_init = (source / "horovod/tensorflow/keras/__init__.py").read_text()
    assert "K = keras.backend" in keras_init and "from keras import backend" not in keras_init
    util = (source / "horovod/tensorflow/util.py").read_text()
    assert "def var_ref(var)" in util and "def tf_variable(var)" in util
    assert ".ref()" not in (source / "horovod/tensorflow/gradient_aggregation.py").read_text()
    # A second application is refused (the patch set is all or nothing per file).
    with pytest.raises(BuildError, match="could not apply 0001"):
        horovod_build.apply_patches(source)


def test_the_installed_horovod_is_the_build_for_this_stack() -> None:
    """What `make setup` installed: built here with the current patch set against the
    TensorFlow of this environment -- a changed patch or another TensorFlow is another key."""
    target = horovod_build.probe(sys.executable, "cpu")
    import tensorflow as tf  # noqa: PLC0415 - the version the key must name

    assert target.tensorflow == tf.__version__
    assert horovod_build.installed_key(sys.executable) == target.key()
    assert f"-tf{tf.__version__}-" in target.key()
    assert horovod_build.patch_digest()[:12] in target.key()


def test_the_cpu_stack_installed_no_cuda_build_of_tensorflow() -> None:
    """`make setup` pins tensorflow-cpu; tf-keras, which names `tensorflow` (the CUDA build) as
    its dependency, is installed without it: no second TensorFlow, no NVIDIA wheels."""
    names = {
        dist.metadata["Name"].lower().replace("_", "-")
        for dist in importlib.metadata.distributions()
    }
    assert "tensorflow-cpu" in names
    assert "tensorflow" not in names
    assert not sorted(n for n in names if n.startswith("nvidia-"))


def test_keys_differ_by_tensorflow_python_and_gpu_operations() -> None:
    keys = {
        Target("3.11", "2.21.0", gpu=False).key(),
        Target("3.11", "2.15.1", gpu=False).key(),
        Target("3.12", "2.21.0", gpu=False).key(),
        Target("3.11", "2.21.0", gpu=True).key(),
    }
    assert len(keys) == 4


def test_an_environment_without_tensorflow_is_told_to_install_it(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True
    )
    python = str(tmp_path / "env" / "bin" / "python")
    with pytest.raises(BuildError, match="has no TensorFlow: install it first"):
        horovod_build.probe(python, "auto")
    done = subprocess.run(
        [sys.executable, "-m", "elastic_allreduce.horovod_build", "--python", python],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("horovod_build: error: ") and "has no TensorFlow" in done.stderr


def test_a_file_that_is_not_the_pinned_sdist_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / horovod_build.SDIST_NAME
    fake.write_bytes(b"not horovod")
    with pytest.raises(BuildError, match=r"is not Horovod 0\.28\.1's sdist"):
        horovod_build.fetch_sdist(sys.executable, tmp_path, fake)
