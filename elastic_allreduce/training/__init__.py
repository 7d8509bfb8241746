"""The training API: what a script calls (``ea.State``, ``ea.run``, ``ea.ElasticData``, warm
joiners, the collective clock, TensorBoard summaries, the sample audit).

:data:`API` names it once, without importing TensorFlow: :mod:`.api` exports these names and
``elastic_allreduce`` hands them on as ``ea.*`` on first use.
"""

from __future__ import annotations

from typing import Final

#: The names of :mod:`elastic_allreduce.training.api` that a script uses as ``ea.<name>``.
API: Final = (
    "ArraySource",
    "Batch",
    "CommitStateCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "ElasticData",
    "KerasFeed",
    "RecordSource",
    "ScaleLearningRate",
    "Source",
    "State",
    "TFRecordSource",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "allreduce",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "run",
    "shutdown",
    "size",
    "warm_up",
)
