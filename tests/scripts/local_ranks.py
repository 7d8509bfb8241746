"""What a script under elastic-run reads from Horovod's local ranks (issue #39, item 5): the
bootstrap's hooks installed in a process whose agent variables say slot ``n3.2`` of a node of
4 (real Horovod at size 1: its own local rank is 0 of 1).

Prints one JSON line: each binding's local rank and size before ``hvd.init()`` (the error's
type) and after it, and what Horovod's C++ side keeps (its op).
"""

import json
import os

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
from horovod.tensorflow import mpi_ops

import elastic_allreduce as ea
from elastic_allreduce.bootstrap import hooks
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore

# What the agent gives slot 2 of a node of 4.
os.environ["ELASTIC_ALLREDUCE_SLOT"] = "n3.2"
os.environ["ELASTIC_ALLREDUCE_LOCAL_SIZE"] = "4"


def before_init(call):
    try:
        return call()
    except ValueError as exc:
        return type(exc).__name__


with EmbeddedEtcd() as etcd, EtcdStore(etcd.endpoints_text, "local") as store:
    hooks.install(store)
    import horovod.keras as hvd_standalone_keras  # imported after the hooks, as a script would

    results = {"before_init": before_init(hvd.local_rank)}
    hvd.init()
    results.update(
        {
            "hvd": [hvd.local_rank(), hvd.local_size()],
            "hvd_keras": [hvd_keras.local_rank(), hvd_keras.local_size()],
            "mpi_ops": [mpi_ops.local_rank(), mpi_ops.local_size()],
            "horovod_keras": [hvd_standalone_keras.local_rank(), hvd_standalone_keras.local_size()],
            "ea": [ea.local_rank(), ea.local_size()],
            "horovod_internal": [int(hvd.local_rank_op()), int(hvd.local_size_op())],
            "rank_size": [hvd.rank(), hvd.size()],
        }
    )
print(json.dumps(results))
