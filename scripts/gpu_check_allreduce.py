"""One process of gpu-check's allreduce sweep (started by ``horovodrun``; scripts/gpu_check.py).

Each process takes the GPU of its local rank (every GPU stays visible to it, as under
elastic-run), allreduces float32 tensors of each size with Horovod, which sends GPU tensors
through NCCL, and times the calls; rank 0 prints one line, ``GPU_CHECK_RESULT {json}``, with
the slowest rank's mean seconds per call and whether every sum was right. ``--framework``:
TensorFlow (the product's) or PyTorch (scripts/gpu_check_framework.py). ``--share-gpu``: the
processes share one GPU, each under its own NCCL host id, so they talk through NCCL's network
transport. ``--cpu``: the plumbing only, on the CPU with Gloo (no GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_framework import FRAMEWORKS, Framework, share_gpu_host_id

parser = argparse.ArgumentParser()
parser.add_argument("--sizes-mib", default="1,4,16,64,256")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--seconds", type=float, default=1.0, help="about this long per size")
parser.add_argument("--framework", choices=FRAMEWORKS, default="tensorflow")
parser.add_argument("--share-gpu", action="store_true")
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

fw = Framework(args.framework, args.cpu)
fw.init()
hvd = fw.hvd
if args.share_gpu:
    share_gpu_host_id(f"rank-{hvd.rank()}")


def slowest(seconds: float) -> float:
    return fw.across_ranks(seconds, hvd.Max, "gpu_check.seconds")


results = []
for size_mib in (int(size) for size in args.sizes_mib.split(",")):
    count = size_mib * 2**20 // 4
    tensor = fw.ones(count)
    name = f"gpu_check.{size_mib}"
    for _ in range(args.warmup):
        summed = fw.allreduce(tensor, name)
    fw.value(summed, -1)
    # As many calls as fill about --seconds, decided from the warm-up, the same on all ranks.
    start = time.perf_counter()
    fw.value(fw.allreduce(tensor, name), -1)
    calls = max(3, min(200, int(args.seconds / max(slowest(time.perf_counter() - start), 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        summed = fw.allreduce(tensor, name)
    last = fw.value(summed, -1)  # waits for the last call
    elapsed = slowest((time.perf_counter() - start) / calls)
    right = last == hvd.size() and fw.value(summed, 0) == hvd.size()
    correct = fw.across_ranks(1.0 if right else 0.0, hvd.Min, "gpu_check.correct") == 1.0
    results.append({"bytes": count * 4, "calls": calls, "seconds": elapsed, "correct": correct})

if hvd.rank() == 0:
    record = {"size": hvd.size(), "device": fw.device, "framework": fw.name, "results": results}
    print("GPU_CHECK_RESULT " + json.dumps(record), flush=True)
