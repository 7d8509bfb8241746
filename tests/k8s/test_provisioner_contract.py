"""One contract for every provisioner: local agent processes and Kubernetes pods.

Real etcd and real agents (`python -m launcher.node.agent` locally; `elastic-run join` in the fake
cluster's pods); only the Kubernetes API is a fake. The job has a configuration but no launcher
yet, so agents register and wait: enough to see nodes come and go through the store.
tests/kube/test_provisioner_contract.py runs these same functions against the real API server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from elastic_allreduce.records import keys
from elastic_allreduce.records.values import MemberRecord
from elastic_allreduce.store import EmbeddedEtcd, EtcdStore
from launcher.k8s.provisioner import KubernetesProvisioner, KubernetesSettings
from launcher.provisioners.api import Provisioner
from launcher.provisioners.local import LocalProvisioner
from launcher.vocabulary import NodeTemplate
from tests.conftest import ROOT
from tests.helpers.fake_kube import FakeKube
from tests.k8s.conftest import StoreView, join_template, write_job_config

pytestmark = pytest.mark.timeout(120)

#: A script that exists (an agent refuses a job whose script is missing on its host); no
#: launcher runs here, so it is never started.
COMMAND = ["python", str(ROOT / "tests" / "scripts" / "hvd_elastic.py")]


@dataclass
class Subject:
    provisioner: Provisioner
    #: Whether the node's agent process still runs (a pod's process, or a local process).
    running: Callable[[str], bool]


def local_subject(etcd: EmbeddedEtcd, job_id: str) -> Iterator[Subject]:
    template = NodeTemplate(
        etcd=etcd.endpoints_text,
        job_id=job_id,
        nproc_per_node=1,
        command=tuple(COMMAND),
    )
    provisioner = LocalProvisioner(template)

    def running(node: str) -> bool:
        agent = provisioner._agents.get(node)
        return agent is not None and agent.poll() is None

    yield Subject(provisioner, running)
    provisioner.close()


def kubernetes_subject(etcd: EmbeddedEtcd, job_id: str) -> Iterator[Subject]:
    with FakeKube(run_pods=True) as kube, kube.kube() as api:
        settings = KubernetesSettings(
            namespace="default",
            job_id=job_id,
            etcd=etcd.endpoints_text,
            worker_template=join_template(),
        )
        provisioner = KubernetesProvisioner(settings, api)
        yield Subject(provisioner, lambda node: kube.pid(node) is not None)
        provisioner.close()


@pytest.fixture(params=["local", "kubernetes"])
def subject(
    request: pytest.FixtureRequest, etcd_server: EmbeddedEtcd, job_id: str, job_store: EtcdStore
) -> Iterator[Subject]:
    write_job_config(job_store, COMMAND)
    factory = local_subject if request.param == "local" else kubernetes_subject
    yield from factory(etcd_server, job_id)


def test_started_nodes_register_in_the_store(subject: Subject, store_view: StoreView) -> None:
    nodes = subject.provisioner.start_nodes(2)
    assert len(set(nodes)) == 2
    store_view.wait(lambda: set(store_view.members()) == set(nodes), 60, "both nodes to register")
    more = subject.provisioner.start_nodes(1)
    assert not set(more) & set(nodes)
    store_view.wait(
        lambda: set(store_view.members()) == {*nodes, *more}, 60, "the third node to register"
    )


def test_stop_node_makes_one_node_leave_gracefully(subject: Subject, store_view: StoreView) -> None:
    nodes = subject.provisioner.start_nodes(2)
    store_view.wait(lambda: set(store_view.members()) == set(nodes), 60, "nodes to register")
    leaver, stayer = nodes
    subject.provisioner.stop_node(leaver)
    store_view.wait(lambda: leaver not in store_view.members(), 60, f"{leaver} to leave")
    # Graceful: the agent announced its leave (a killed agent's key would just expire).
    announced = [
        MemberRecord.from_json(key, value)
        for key, value in store_view.history
        if key == keys.member(leaver) and value is not None
    ]
    assert any(member.leaving for member in announced), announced
    assert stayer in store_view.members()
    store_view.wait(lambda: not subject.running(leaver), 30, f"{leaver}'s agent to exit")
    assert subject.running(stayer)


def test_close_stops_every_node_and_is_idempotent(subject: Subject, store_view: StoreView) -> None:
    nodes = subject.provisioner.start_nodes(2)
    store_view.wait(lambda: set(store_view.members()) == set(nodes), 60, "nodes to register")
    subject.provisioner.close()
    store_view.wait(lambda: not store_view.members(), 30, "every node to leave")
    assert not any(subject.running(node) for node in nodes)
    subject.provisioner.close()
