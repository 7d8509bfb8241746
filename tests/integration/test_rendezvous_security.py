"""The launcher's rendezvous against a client on the network that is not a worker: a crafted
pickle in a worker registration runs nothing, and no worker's notification key is served."""

from __future__ import annotations

import base64
import pickle
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from elastic_allreduce.records.snapshot import read_job
from elastic_allreduce.rendezvous import protocol
from elastic_allreduce.store import EmbeddedEtcd
from tests.helpers.pickles import Exploit
from tests.integration.harness import Job, start_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRAIN = ("--steps", "150", "--commit-every", "5", "--step-delay", "0.03")


def _request(url: str, method: str, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, method=method)  # noqa: S310 - http only
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_crafted_pickle_is_refused_and_no_key_is_served(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    job = start_job(etcd_server, "--workers", "2", script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 2, 120, "commits at size 2")
    snapshot = read_job(job.store)
    assert snapshot.leader is not None and snapshot.leader.record.rendezvous is not None
    assert snapshot.ring is not None
    base = protocol.base_url(snapshot.leader.record.rendezvous)
    slot = snapshot.ring.record.slots[0]
    marker = tmp_path / "pwned"
    payload = (({"lo": [("127.0.0.1", 1)]}, Exploit(marker)), Exploit(marker))
    for crafted in payload:
        body = base64.b64encode(pickle.dumps(crafted))
        url = f"{base}/{protocol.WORKER_ADDRESSES}/{protocol.worker_key(slot)}"
        assert _request(url, "PUT", body) == 400
    assert not marker.exists()
    # The live workers registered their notification keys; none is served back.
    for member in snapshot.ring.record.slots:
        url = f"{base}/{protocol.WORKER_ADDRESSES}/{protocol.worker_key(member)}"
        assert _request(url, "GET") == 404
    assert job.finish() == 0, job.tail()
    assert not marker.exists()
    assert sum("refused a worker_addresses registration" in line for line in job.lines) == 2
    assert len(job.done()) == 2
