"""Benchmark workload: allreduce time vs message size, Horovod (under elastic-run) or MPI.

``python allreduce_bw.py --sizes B1,B2,...`` under `elastic-run` uses Horovod's allreduce as a
training process runs it (eager ``hvd.allreduce``, sum, float32); ``--mpi`` under ``mpirun``
uses mpi4py's ``Allreduce`` on NumPy arrays. Every rank does the same number of operations
(``reps_for``); rank 0 prints one JSON record per size:
{"event": "allreduce", "bytes": B, "reps": R, "seconds": total seconds of the R operations}.
"""

import argparse
import json
import math
import time

import numpy as np


def reps_for(size: int, budget: int) -> int:
    """Operations per size: about ``budget`` bytes in all, at least 3, at most 200."""
    return max(3, min(200, math.ceil(budget / size)))


parser = argparse.ArgumentParser()
parser.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
parser.add_argument("--budget", type=int, default=1 << 28, help="bytes per size (sets reps)")
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--mpi", action="store_true", help="mpi4py instead of Horovod")
args = parser.parse_args()
sizes = [int(s) for s in args.sizes.split(",")]

if args.mpi:
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size_ = comm.Get_rank(), comm.Get_size()

    def make(nbytes):
        return np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)

    def allreduce(buffers, name):
        comm.Allreduce(buffers[0], buffers[1], op=MPI.SUM)

    def barrier():
        comm.Barrier()

    library = MPI.Get_library_version().split(",")[0].strip("\x00 \n")
    backend = f"mpi4py {mpi4py.__version__}, {library}"
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, size_ = hvd.rank(), hvd.size()

    def make(nbytes):
        return tf.ones([nbytes // 4], dtype=tf.float32)

    def allreduce(tensor, name):
        hvd.allreduce(tensor, op=hvd.Sum, name=name).numpy()

    def barrier():
        hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name="bench.barrier").numpy()

    backend = "horovod"

if rank == 0:
    print(json.dumps({"event": "backend", "backend": backend, "size": size_}), flush=True)
for nbytes in sizes:
    buffers = make(nbytes)
    name = f"bench.allreduce.{nbytes}"
    for _ in range(args.warmup):
        allreduce(buffers, name)
    reps = reps_for(nbytes, args.budget)
    barrier()
    start = time.perf_counter()
    for _ in range(reps):
        allreduce(buffers, name)
    seconds = time.perf_counter() - start
    if rank == 0:
        record = {"event": "allreduce", "bytes": nbytes, "reps": reps, "seconds": seconds}
        print(json.dumps(record), flush=True)
    del buffers
