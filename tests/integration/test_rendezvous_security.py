"""The launcher's rendezvous against a client on the network that is not a worker: without the
launcher's token every request is refused (403) and changes nothing -- a forged reset of a live
slot starts no epoch; with it (someone who can read the job's keys) a crafted pickle in a worker
registration runs nothing; no worker's notification key is served either way."""

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


def _request(url: str, method: str, body: bytes | None = None, token: str | None = None) -> int:
    headers = {} if token is None else {protocol.TOKEN_HEADER: token}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_requests_without_the_token_are_refused_and_a_crafted_pickle_runs_nothing(
    etcd_server: EmbeddedEtcd, jobs: list[Job], tmp_path: Path
) -> None:
    job = start_job(etcd_server, "--workers", "2", script_args=TRAIN)
    jobs.append(job)
    job.wait_for(lambda: len(job.commits(2)) >= 2, 120, "commits at size 2")
    snapshot = read_job(job.store)
    assert snapshot.leader is not None and snapshot.leader.record.rendezvous is not None
    assert snapshot.ring is not None
    base = protocol.base_url(snapshot.leader.record.rendezvous)
    token = snapshot.leader.record.token
    assert token is not None
    epoch = snapshot.ring.record.epoch
    slot = snapshot.ring.record.slots[0]

    # Without the token (or with a wrong one): 403 for everything, a live slot's reset included.
    forged = [
        ("GET", f"{protocol.RANK_AND_SIZE}/{protocol.worker_key(slot)}", None),
        ("GET", f"{protocol.ELASTIC_READY}/{slot}", None),
        ("GET", f"{protocol.NODE_STANDING}/{slot.split('.')[0]}", None),
        ("PUT", "global/forged", b"x"),
        ("DELETE", "global", None),
    ]
    for wrong in (None, "not-the-token"):
        for method, path, body in forged:
            assert _request(f"{base}/{path}", method, body, wrong) == 403, (method, path)

    marker = tmp_path / "pwned"
    payload = (({"lo": [("127.0.0.1", 1)]}, Exploit(marker)), Exploit(marker))
    url = f"{base}/{protocol.WORKER_ADDRESSES}/{protocol.worker_key(slot)}"
    for crafted in payload:
        body = base64.b64encode(pickle.dumps(crafted))
        assert _request(url, "PUT", body) == 403
        # Even with the token, the plain-data loader reads the registration: nothing runs.
        assert _request(url, "PUT", body, token) == 400
    assert not marker.exists()
    # The live workers registered their notification keys; none is served back.
    for member in snapshot.ring.record.slots:
        url = f"{base}/{protocol.WORKER_ADDRESSES}/{protocol.worker_key(member)}"
        assert _request(url, "GET") == 403
        assert _request(url, "GET", token=token) == 404

    # Training went on in the same epoch: the forged reset started none.
    done = len(job.commits(2))
    job.wait_for(lambda: len(job.commits(2)) >= done + 3, 120, "commits after the requests")
    after = read_job(job.store)
    assert after.ring is not None and after.ring.record.epoch == epoch
    assert job.finish() == 0, job.tail()
    assert not marker.exists()
    assert sum("refused a worker_addresses registration" in line for line in job.lines) == 2
    assert sum("refused GET /rank_and_size" in line for line in job.lines) == 2
    assert len(job.done()) == 2
