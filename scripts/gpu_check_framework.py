"""The framework gpu-check's Horovod scripts run on: TensorFlow (the product's) or PyTorch.

A GPU machine without TensorFlow (the project's lent device machine has PyTorch and Python
3.12, for which no TensorFlow 2.15 exists) can still show how Horovod's NCCL operations behave:
Horovod's C++ core (controller, Gloo, NCCL) is the same under both; only this thin adapter
differs. ``--cpu`` keeps every tensor on the CPU (Gloo), to test the plumbing without a GPU.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

FRAMEWORKS = ("tensorflow", "torch")


class Framework:
    """``hvd`` plus tensors on this process's device."""

    def __init__(self, name: str, cpu: bool) -> None:
        if name not in FRAMEWORKS:
            raise ValueError(f"unknown framework {name!r}: use one of {FRAMEWORKS}")
        self.name, self.cpu = name, cpu
        self.lib: Any = importlib.import_module(name)
        self.hvd: Any = importlib.import_module(f"horovod.{name}")
        self.device = "cpu"
        self._selected = False

    def init(self) -> None:
        """``hvd.init()``; the first time, also pick the local rank's GPU (all stay visible)."""
        self.hvd.init()
        if self._selected or self.cpu:
            return
        self._selected = True
        index = self.hvd.local_rank()
        if self.name == "torch":
            torch = self.lib
            index %= torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = f"cuda:{index}"
        else:
            tf = self.lib
            gpus = tf.config.list_physical_devices("GPU")
            mine = gpus[index % len(gpus)]
            tf.config.set_visible_devices(mine, "GPU")
            tf.config.experimental.set_memory_growth(mine, True)
            self.device = "/GPU:0"

    def ones(self, count: int) -> Any:  # noqa: ANN401
        """A float32 tensor of ``count`` ones on this process's device."""
        if self.name == "torch":
            device = "cpu" if self.cpu else self.device
            return self.lib.ones(count, dtype=self.lib.float32, device=device)
        with self.lib.device("/CPU:0" if self.cpu else self.device):
            return self.lib.ones([count], self.lib.float32)

    def allreduce(self, tensor: Any, name: str) -> Any:  # noqa: ANN401
        """The sum over every rank (NCCL for GPU tensors, Gloo for CPU ones)."""
        if self.name == "torch":
            return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)
        with self.lib.device("/CPU:0" if self.cpu else self.device):
            return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)

    @staticmethod
    def value(tensor: Any, index: int) -> float:  # noqa: ANN401
        """One element as a float; waits for the operation that made it."""
        return float(tensor[index])

    def across_ranks(self, value: float, op: Any, name: str) -> float:  # noqa: ANN401
        """``value`` reduced over every rank with ``op`` (a CPU allreduce, through Gloo)."""
        if self.name == "torch":
            tensor = self.lib.tensor([value], dtype=self.lib.float64)
            return float(self.hvd.allreduce(tensor, op=op, name=name)[0])
        with self.lib.device("/CPU:0"):
            tensor = self.lib.constant(value, self.lib.float64)
            return float(self.hvd.allreduce(tensor, op=op, name=name))


def share_gpu_host_id(tag: str) -> None:
    """Give this process its own NCCL host id: NCCL refuses two ranks of one host on one GPU, so
    processes sharing the only GPU must look like different hosts (they then talk through
    NCCL's network transport). Read when Horovod creates its communicator, at the first GPU
    allreduce."""
    os.environ["NCCL_HOSTID"] = f"gpu-check-{tag}"
