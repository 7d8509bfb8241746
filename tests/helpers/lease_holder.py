"""A separate process that holds a key under a lease until it is killed.

Usage: python -m tests.helpers.lease_holder ENDPOINTS JOB_ID KEY TTL
Prints "ready <revision>" once the key is written, then waits for stdin to close (or a signal).
"""

from __future__ import annotations

import sys

from elastic_allreduce.store import EtcdStore


def main() -> int:
    endpoints, job_id, key, ttl = sys.argv[1:5]
    store = EtcdStore(endpoints, job_id)
    lease = store.grant_lease(int(ttl))
    revision = store.put(key, {"holder": "lease_holder", "lease": lease.id}, lease=lease)
    print(f"ready {revision}", flush=True)
    sys.stdin.read()  # returns when the parent closes our stdin; SIGKILL ends us earlier
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
