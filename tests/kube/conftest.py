"""Fixtures: one private Kubernetes control plane for the whole session (tests.helpers.kube).

The control plane's binary is built by ``make kube-build`` (``make test-kube`` does it first).
Run directly (``pytest tests/kube``), the suite builds it at collection time, before any test
and its timeout start, when Go is there; the tests that need the cluster skip, with the reason,
only where it cannot be built or cannot run (no Go, a failed build, not root, no ``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.kube.cluster import ROOT, KubeCluster, missing_binary_reason

#: Nodes of the process kubelet in the session's cluster (0: the control plane only), and the
#: ``nvidia.com/gpu`` each reports (only counted by the scheduler: no GPU is used).
NODES = 2
GPUS_PER_NODE = 2
#: hostPath PersistentVolumes: each overlay's claims (base and gpu-example: 3 etcd members and
#: the checkpoints) bind one, and the namespaces of the tests are deleted without waiting.
VOLUMES = 12
#: Seconds a cold build may take (about 6 minutes on 2 cores).
BUILD_TIMEOUT = 1800.0

_build_problem: list[str] = []  # why the binary could not be built (set at collection)


def _build_binary() -> str | None:
    """Build the control plane's binary with make if it is missing or stale; None when it is
    usable, else why not."""
    make = ["make", "--no-print-directory", "-C", str(ROOT)]
    up_to_date = subprocess.run([*make, "-q", "kube-build"], capture_output=True, check=False)
    if up_to_date.returncode == 0:
        return None
    if shutil.which(os.environ.get("GO", "go")) is None:
        missing = missing_binary_reason()
        if missing is None:
            return None  # stale but present: use it
        return f"Go is not installed, so the Kubernetes control plane cannot be built ({missing})"
    try:
        done = subprocess.run(
            [*make, "kube-build"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"`make kube-build` ran past {BUILD_TIMEOUT} s"
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        return f"`make kube-build` failed (exit code {done.returncode}):\n{tail}"
    return missing_binary_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the binary before the run when a test of this folder was collected (a cold build
    takes minutes: longer than a test may)."""
    here = Path(__file__).parent
    if _build_problem or not any(here in Path(item.path).parents for item in items):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and missing_binary_reason() is not None:
        reporter.write_line("tests/kube: building the Kubernetes control plane (make kube-build)")
    _build_problem.append(_build_binary() or "")


def cluster_unavailable() -> str | None:
    """Why the cluster cannot run here (for ``pytest.skip``), or None."""
    if _build_problem and _build_problem[0]:
        return _build_problem[0]
    missing = missing_binary_reason()
    if missing is not None:
        return missing
    if os.geteuid() != 0:
        return f"the test cluster needs root (network namespaces); this runs as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """The session's cluster: etcd, API server, scheduler and controller manager (and
    ``NODES`` process-kubelet nodes), started once, stopped at the end of the session."""
    reason = cluster_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = KubeCluster(
        tmp_path_factory.mktemp("kube"), nodes=NODES, gpus_per_node=GPUS_PER_NODE, volumes=VOLUMES
    )
    cluster.start()
    print(f"\ntest cluster {cluster.prefix} started in {cluster.startup_seconds:.1f} s")
    try:
        yield cluster
    finally:
        cluster.close()
