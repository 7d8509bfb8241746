"""One process of gpu-check's allreduce sweep (started by ``horovodrun``; scripts/gpu_check.py).

Each process takes the GPU of its local rank (every GPU stays visible to it, as under
elastic-run), allreduces float32 tensors of each size with Horovod, which sends GPU tensors
through NCCL, and times the calls; rank 0 prints one line, ``GPU_CHECK_RESULT {json}``, with
the slowest rank's mean seconds per call and whether every sum was right. ``--share-gpu``: the
processes share one GPU, each under its own NCCL host id (NCCL refuses two ranks of one host on
one device), so they talk through NCCL's network transport. ``--cpu``: the plumbing only, on
the CPU with Gloo (no GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import horovod.tensorflow as hvd
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--sizes-mib", default="1,4,16,64,256")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--seconds", type=float, default=1.0, help="about this long per size")
parser.add_argument("--share-gpu", action="store_true")
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

hvd.init()
if args.share_gpu:
    # Read by NCCL when Horovod creates its communicator, at the first GPU allreduce.
    os.environ["NCCL_HOSTID"] = f"gpu-check-rank-{hvd.rank()}"
device = "/CPU:0"
if not args.cpu:
    gpus = tf.config.list_physical_devices("GPU")
    mine = gpus[hvd.local_rank() % len(gpus)]
    tf.config.set_visible_devices(mine, "GPU")
    tf.config.experimental.set_memory_growth(mine, True)
    device = "/GPU:0"


def across_ranks(value: float, op: object, name: str) -> float:
    """``value`` reduced over every rank with ``op`` (a CPU allreduce, through Gloo)."""
    with tf.device("/CPU:0"):
        return float(hvd.allreduce(tf.constant(value, tf.float64), op=op, name=name))


def slowest(seconds: float) -> float:
    return across_ranks(seconds, hvd.Max, "gpu_check.seconds")


results = []
with tf.device(device):
    for size_mib in (int(size) for size in args.sizes_mib.split(",")):
        count = size_mib * 2**20 // 4
        tensor = tf.ones([count], tf.float32)
        name = f"gpu_check.{size_mib}"
        for _ in range(args.warmup):
            summed = hvd.allreduce(tensor, op=hvd.Sum, name=name)
        float(summed[-1])
        # As many calls as fill about --seconds, decided from the warm-up, the same on all ranks.
        start = time.perf_counter()
        float(hvd.allreduce(tensor, op=hvd.Sum, name=name)[-1])
        calls = max(
            3, min(200, int(args.seconds / max(slowest(time.perf_counter() - start), 1e-6)))
        )
        start = time.perf_counter()
        for _ in range(calls):
            summed = hvd.allreduce(tensor, op=hvd.Sum, name=name)
        last = float(summed[-1])  # waits for the last call
        elapsed = slowest((time.perf_counter() - start) / calls)
        right = last == hvd.size() and float(summed[0]) == hvd.size()
        correct = across_ranks(1.0 if right else 0.0, hvd.Min, "gpu_check.correct") == 1.0
        results.append({"bytes": count * 4, "calls": calls, "seconds": elapsed, "correct": correct})

if hvd.rank() == 0:
    record = {"size": hvd.size(), "device": device, "results": results}
    print("GPU_CHECK_RESULT " + json.dumps(record), flush=True)
