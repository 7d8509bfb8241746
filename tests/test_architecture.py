"""Layering rules that the code must keep."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_worker_library_never_imports_the_launcher() -> None:
    sources = sorted((ROOT / "elastic_allreduce").rglob("*.py"))
    assert sources, "no sources found"
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] == "launcher"
        )
        for path in sources
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_itself_would_catch_an_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom launcher.cli import main\n")
    assert "launcher.cli" in imported_modules(sample)


def test_the_lazy_training_api_names_match_the_worker_module() -> None:
    import elastic_allreduce  # noqa: PLC0415
    from elastic_allreduce import worker  # noqa: PLC0415 - imports TensorFlow

    assert frozenset(worker.__all__) == elastic_allreduce._WORKER_NAMES
    assert elastic_allreduce.State is worker.State
