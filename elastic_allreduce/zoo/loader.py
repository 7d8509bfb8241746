"""Finding what ``elastic-run train`` was given: the model definition, the data files and the
output folder. Every failure is a ConfigError that names the flag or the definition."""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.zoo.contract import ModelDef, check_definition

_GLOB_CHARACTERS = frozenset("*?[")


def is_file_spec(spec: str) -> bool:
    """Whether ``--model-def`` names a file (``.py`` or a path) rather than a module."""
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def import_model_def(spec: str) -> ModelDef:
    """Import the definition ``spec`` (a ``.py`` file, or a module on ``sys.path``) and check
    its names and signatures."""
    module = _import(spec)
    source = getattr(module, "__file__", None)
    return check_definition(spec, vars(module), source_file=source)


def _import(spec: str) -> ModuleType:
    if not is_file_spec(spec):
        try:
            return importlib.import_module(spec)
        except ModuleNotFoundError as exc:
            if exc.name is not None and spec.startswith(exc.name):
                raise ConfigError(
                    f"model definition {spec}: no such module or file (give a .py file, or a "
                    "module importable from the current folder or PYTHONPATH)"
                ) from exc
            raise _import_error(spec, exc) from exc
        except Exception as exc:
            raise _import_error(spec, exc) from exc
    path = Path(spec).resolve()
    if not path.is_file():
        raise ConfigError(f"model definition {spec}: no such file ({path})")
    name = path.stem if path.suffix == ".py" else path.name
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"model definition {spec}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(loader_spec)
    # Its folder on sys.path: the definition may import its neighbours.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _import_error(spec, exc) from exc
    return module


def _import_error(spec: str, exc: Exception) -> ConfigError:
    return ConfigError(f"model definition {spec}: importing it raised {type(exc).__name__}: {exc}")


def expand_paths(patterns: Sequence[str], flag: str) -> list[str]:
    """Every file of ``patterns`` (paths or glob patterns; each pattern's matches sorted), as
    absolute paths, in order and without repeats; ConfigError naming ``flag`` for a pattern
    that matches nothing or a path that is not a file."""
    files: list[str] = []
    for pattern in patterns:
        if _GLOB_CHARACTERS & set(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise ConfigError(f"{flag}: the pattern {pattern!r} matches no file")
        elif os.path.isfile(pattern):
            matches = [pattern]
        else:
            what = (
                "is a folder (give files or a pattern)"
                if os.path.isdir(pattern)
                else "does not exist"
            )
            raise ConfigError(f"{flag}: {pattern!r} {what}")
        for match in matches:
            absolute = os.path.abspath(match)
            if absolute not in files:
                files.append(absolute)
    return files


def check_output_dir(path: str) -> None:
    """Refuse an ``--output`` that exists and is not an empty folder (nothing is overwritten)."""
    folder = Path(path)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ConfigError(f"--output {path} exists and is not a folder: give a new folder")
    if any(folder.iterdir()):
        raise ConfigError(
            f"--output {path} exists and is not empty: give a new or empty folder (nothing is "
            "overwritten)"
        )
