"""The local provisioner adopts the agents a previous launcher of the job left running, and
only those: a pid read from the store is signalled only if it is this job's agent of that node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from elastic_allreduce.records.values import MemberRecord
from launcher.provisioners.local import LocalProvisioner
from launcher.vocabulary import NodeTemplate

TEMPLATE = NodeTemplate(etcd="127.0.0.1:1", job_id="job-a", nproc_per_node=1, command=("true",))

#: Looks like ``python -m launcher.node.agent PAYLOAD`` to /proc/<pid>/cmdline, says so, and waits
#: for SIGTERM.
LOOKALIKE = "import signal; print('ready', flush=True); signal.sigwait({signal.SIGTERM})"


def lookalike(job_id: str, node_id: str) -> subprocess.Popen[bytes]:
    """A lookalike agent whose command line is in place: right after Popen returns, the
    kernel may not have set it yet (the exec is still under way)."""
    payload = json.dumps({"job_id": job_id, "node_id": node_id})
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOKALIKE, "launcher.node.agent", payload], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_only_this_job_s_agent_of_the_node_is_adopted_and_stopped(
    processes: list[subprocess.Popen[bytes]],
) -> None:
    mine = lookalike("job-a", "n3")
    other_job = lookalike("job-b", "n1")
    other_node = lookalike("job-a", "n2")
    processes += [mine, other_job, other_node]
    members = {
        "n3": MemberRecord("127.0.0.1", 1, mine.pid),
        "n1": MemberRecord("127.0.0.1", 1, other_job.pid),  # another job's agent
        "n0": MemberRecord("127.0.0.1", 1, other_node.pid),  # an agent, of another node
        "n5": MemberRecord("127.0.0.1", 1, os.getpid()),  # a recycled pid: not an agent
        "j77": MemberRecord("127.0.0.1", 1, None),  # a joined node: nothing to adopt
    }
    provisioner = LocalProvisioner(TEMPLATE, outlive_launcher=True)
    assert provisioner.adopt(members) == {"n3"}  # managed from now on
    for node in members:
        provisioner.stop_node(node)
    assert mine.wait(timeout=10) is not None  # SIGTERM: the adopted agent leaves
    for proc in (other_job, other_node):
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    provisioner.close()  # idempotent for a node already gone


def test_close_stops_adopted_agents(processes: list[subprocess.Popen[bytes]]) -> None:
    agent = lookalike("job-a", "n0")
    processes.append(agent)
    provisioner = LocalProvisioner(TEMPLATE, outlive_launcher=True)
    provisioner.adopt({"n0": MemberRecord("127.0.0.1", 1, agent.pid)})
    provisioner.close(timeout=10)
    assert agent.poll() is not None
