"""Which GPU a training process computes on: its slot's, chosen inside TensorFlow.

The agent leaves every GPU of the node visible to each of its training processes (an inherited
``CUDA_VISIBLE_DEVICES`` stays as it is) and gives each its slot's index among them in
``ELASTIC_ALLREDUCE_GPU_INDEX``; :func:`select` then limits TensorFlow to that one GPU, with
memory growth, before the training script runs.

Why not ``CUDA_VISIBLE_DEVICES=<index>`` per process: NCCL's peer-to-peer and shared-memory
transports between two processes of one node open the peer's device, which such a process
cannot see, so NCCL falls back to slower paths or fails. Horovod's TensorFlow recipe keeps every
GPU visible and pins one per process with ``tf.config.set_visible_devices``; it takes the index
from ``hvd.local_rank()``, which Horovod's C++ side keeps at 0 here (every slot is a host of its
own), hence the agent's variable -- and the hooks make the script's ``hvd.local_rank()`` return
the same index, so a script's own recipe picks this GPU again. Memory growth: TensorFlow
would otherwise take nearly all of the GPU's memory at start, and NCCL needs some for the
communicators Horovod re-creates after every elastic reset.

:func:`device_index` and :func:`choose` are the pure part; :func:`select` asks TensorFlow.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from elastic_allreduce import env, runtime
from elastic_allreduce.errors import ConfigError

log = logging.getLogger(__name__)


def device_index(environ: Mapping[str, str]) -> int | None:
    """The slot's GPU index from ``environ`` (None when unset or empty: no GPU chosen).
    ConfigError unless it is a non-negative integer."""
    return runtime.ProcessContract.from_environ(environ).gpu_index


def choose(index: int | None, count: int) -> int | None:
    """The GPU to keep among the ``count`` that TensorFlow sees: ``index``, or None (leave
    TensorFlow as it is) when there is no GPU or no index. ConfigError when the process sees
    fewer GPUs than the index needs."""
    if index is None or count == 0:
        return None
    if index >= count:
        raise ConfigError(
            f"this training process should use GPU {index} ({env.GPU_INDEX}) but TensorFlow "
            f"sees {count} GPU(s): run at most one training process per GPU "
            "(--nproc-per-node), or give the node more GPUs"
        )
    return index


def select(environ: Mapping[str, str] | None = None) -> int | None:
    """Limit TensorFlow to the slot's GPU (:func:`choose`), with memory growth; the index
    chosen, or None when nothing was changed. Call it before TensorFlow runs anything: once
    its runtime is initialized the devices cannot change, which is logged as a warning."""
    given = runtime.contract() if environ is None else runtime.ProcessContract.from_environ(environ)
    slot = given.slot or "-"
    index = given.gpu_index
    if index is None:
        return None
    import tensorflow as tf  # noqa: PLC0415 - the worker side only; slow to import

    config: Any = tf.config
    gpus = config.list_physical_devices("GPU")
    chosen = choose(index, len(gpus))
    if chosen is None:
        log.debug("no GPU visible to TensorFlow: %s=%d changes nothing", env.GPU_INDEX, index)
        return None
    gpu = gpus[chosen]
    if config.get_visible_devices("GPU") == [gpu]:
        return chosen
    try:
        config.set_visible_devices(gpu, "GPU")
        config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as exc:  # TensorFlow's runtime was initialized already
        log.warning(
            "slot %s: could not limit TensorFlow to GPU %d (%s); it uses every visible GPU",
            slot,
            chosen,
            exc,
        )
        return None
    log.info("slot %s: training on GPU %d of %d (%s)", slot, chosen, len(gpus), gpu.name)
    return chosen
