"""Layering rules that the code must keep: the import-linter contracts of pyproject.toml
(`make lint` runs them on the tree; here they are shown to catch a violation)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The two packages and pyproject.toml, to break on purpose."""
    for package in ("elastic_allreduce", "launcher"):
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add_import(path: Path, line: str) -> None:
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest)


def test_the_tree_keeps_every_contract() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (
            # not the runtime: the node agent imports it (for the process contract), so there
            # the import would break the agent's contracts too
            "elastic_allreduce/training/audit.py",
            "import launcher.cli",
            "never imports the control plane",
        ),
        ("elastic_allreduce/records/values.py", "import socket", "do no I/O"),
        (
            "launcher/leader/policy.py",
            "from elastic_allreduce.store import EtcdStore",
            "do no I/O",
        ),
        ("elastic_allreduce/rendezvous/protocol.py", "import urllib.request", "do no I/O"),
        ("elastic_allreduce/zoo/contract.py", "import tensorflow", "do no I/O"),
        ("launcher/vocabulary.py", "import socket", "do no I/O"),
        ("launcher/leader/job.py", "import launcher.node.agent", "never import each other"),
        ("launcher/node/agent.py", "import launcher.leader.policy", "never import each other"),
        ("launcher/status_view.py", "import launcher.cli", "no import cycle"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tree_copy: Path, module: str, line: str, contract: str
) -> None:
    _add_import(tree_copy / module, line)
    result = _lint(tree_copy)
    assert result.returncode != 0, result.stdout
    assert "1 broken" in result.stdout, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[1]
    assert contract in broken, broken


def test_the_training_api_importing_the_bootstrap_breaks_two_contracts(tree_copy: Path) -> None:
    """The bootstrap imports the training API, so any import back is also a cycle."""
    _add_import(
        tree_copy / "elastic_allreduce/training/warm.py", "import elastic_allreduce.bootstrap.gpu"
    )
    result = _lint(tree_copy)
    assert result.returncode != 0, result.stdout
    assert "2 broken" in result.stdout, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[1]
    assert "bootstrap only through the runtime" in broken, broken
    assert "No cycles are allowed in elastic_allreduce" in broken, broken


def test_the_lazy_training_api_names_match_the_worker_module() -> None:
    import elastic_allreduce  # noqa: PLC0415
    from elastic_allreduce.training import api as worker  # noqa: PLC0415 - imports TensorFlow

    assert frozenset(worker.__all__) == elastic_allreduce._WORKER_NAMES
    for name in worker.__all__:
        assert getattr(elastic_allreduce, name) is getattr(worker, name), name
    assert elastic_allreduce.State is worker.State
