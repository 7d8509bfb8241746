"""elastic-allreduce: elastic, fault-tolerant TensorFlow 2 training on Horovod's ring allreduce.

The worker-side library. ``import elastic_allreduce as ea`` gives the training API of
:mod:`elastic_allreduce.training.api` (``ea.init``, ``ea.run``, ``ea.State``, ``ea.rank``, ...),
and ``ea.report_step`` / ``ea.phase`` of :mod:`elastic_allreduce.progress`, all imported on
first use so that the control plane can use :mod:`elastic_allreduce.store` without
loading TensorFlow. This package never imports :mod:`launcher` (the control plane).
"""

from __future__ import annotations

import importlib
from typing import Any

from elastic_allreduce.training import API

__version__ = "0.1.0.dev0"

_WORKER_NAMES = frozenset(API)


#: Progress reporting for the launcher's hang watchdog (no TensorFlow import).
_PROGRESS_NAMES = frozenset({"report_step", "phase"})


def __getattr__(name: str) -> Any:  # noqa: ANN401 - the worker API's objects have many types
    if name in _PROGRESS_NAMES:
        return getattr(importlib.import_module("elastic_allreduce.progress"), name)
    if name in _WORKER_NAMES:
        return getattr(importlib.import_module("elastic_allreduce.training.api"), name)
    raise AttributeError(f"module 'elastic_allreduce' has no attribute {name!r}")
