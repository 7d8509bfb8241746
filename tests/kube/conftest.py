"""Fixtures: one private Kubernetes control plane for the whole session (tests.helpers.kube).

The control plane's binary is built by ``make kube-build`` (``make test-kube`` does it first).
When it is missing or stale and Go is there, the suite builds it: at collection time when these
tests come first (``pytest tests/kube``), else in the background at the lowest CPU priority
while the tests before them run (``make test``), awaited before the first of them and its
timeout start. The tests that need the cluster skip, with the reason, only where it cannot be
built or cannot run (no Go, a failed build, not root, no ``ip``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.k8s.client import Kind, Kube, connect
from tests.helpers.kube.cluster import ROOT, KubeCluster, missing_binary_reason
from tests.helpers.kube.kubelet import KubeletClient

POD = Kind("v1", "Pod", "pods")
NAMESPACE = Kind("v1", "Namespace", "namespaces", namespaced=False)
_numbers = itertools.count(1)

#: Nodes of the process kubelet in the session's cluster (0: the control plane only), and the
#: ``nvidia.com/gpu`` each reports (only counted by the scheduler: no GPU is used).
NODES = 2
GPUS_PER_NODE = 2
#: hostPath PersistentVolumes: each overlay's claims (base and gpu-example: 3 etcd members and
#: the checkpoints) bind one, and the namespaces of the tests are deleted without waiting.
VOLUMES = 12
#: Seconds a cold build may take (about 6 minutes on 2 cores).
BUILD_TIMEOUT = 1800.0
#: Held while ``make kube-build`` runs (one build at a time on this checkout).
BUILD_LOCK = ROOT / "build" / "kube-build.lock"


class _Build:
    """``make kube-build`` when the binary is missing or stale: run at once when the cluster's
    tests come first (``pytest tests/kube``), else in the background at the lowest CPU priority
    while the tests before them run (a cold build takes about 6 minutes on 2 cores: ``make
    test`` would otherwise wait for it), awaited before the first test of this folder starts
    (and before its timeout does)."""

    def __init__(self) -> None:
        self.problem: str | None = None
        self.decided = False
        self._running: subprocess.Popen[str] | None = None
        self._output: Any = None

    def start(self, *, background: bool) -> None:
        self.decided = True
        make = ["make", "--no-print-directory", "-C", str(ROOT)]
        up_to_date = subprocess.run([*make, "-q", "kube-build"], capture_output=True, check=False)
        if up_to_date.returncode == 0:
            return
        if shutil.which(os.environ.get("GO", "go")) is None:
            missing = missing_binary_reason()
            if missing is not None:
                self.problem = (
                    f"Go is not installed, so the Kubernetes control plane cannot be built "
                    f"({missing})"
                )
            return  # stale but present: use it
        self._output = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by wait()
        # Under pytest-xdist every worker collects these tests and gets here: the lock lets one
        # build while the others wait, then find the binary up to date.
        BUILD_LOCK.parent.mkdir(parents=True, exist_ok=True)
        build = ["flock", str(BUILD_LOCK), *make, "kube-build"]
        self._running = subprocess.Popen(
            ["nice", "-n", "19", *build] if background else build,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            text=True,
            # A session of its own: see _lowest_priority.
            start_new_session=background,
        )
        if background:
            _lowest_priority(self._running.pid)
        else:
            self.wait()

    def wait(self) -> None:
        """Wait for a build in flight; its failure becomes :attr:`problem`."""
        running, self._running = self._running, None
        if running is None:
            return
        try:
            code = running.wait(timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            running.kill()
            running.wait()
            self.problem = f"`make kube-build` ran past {BUILD_TIMEOUT} s"
            return
        self._output.seek(0)
        tail = "\n".join(self._output.read().strip().splitlines()[-20:])
        self._output.close()
        if code != 0:
            self.problem = f"`make kube-build` failed (exit code {code}):\n{tail}"
        else:
            self.problem = missing_binary_reason()


def _lowest_priority(session_leader: int) -> None:
    """Give the build's whole session the lowest CPU weight. With the kernel's autogroups
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default), a process's nice value
    counts only against its own session's processes, and every job the tests start is a
    session of its own: a build under ``nice`` alone, in pytest's session, took as much CPU
    as a job's whole session (its compilers were seen at 60 % of one core beside a 3-rank job
    on 2 cores). The autogroup's own nice value weighs the session against the others (two
    busy loops beside it: one at nice 19 in a session of its own got 126 ticks in 5 s to their
    115 each; with its autogroup at 19, 1 tick)."""
    with contextlib.suppress(OSError):  # no autogroups: ``nice`` is enough
        Path(f"/proc/{session_leader}/autogroup").write_text("19")


_build = _Build()


def _here(item: pytest.Item) -> bool:
    return Path(__file__).parent in Path(item.path).parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the build when a test of this folder was collected: in the background unless
    these tests come first. Under pytest-xdist each worker that runs one of these tests starts
    a cluster of its own (session fixture): their namespaces and addresses are private to them.
    """
    mine = [item for item in items if _here(item)]
    if _build.decided or not mine:
        return
    background = not _here(items[0])
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and missing_binary_reason() is not None:
        how = "in the background, at the lowest CPU priority" if background else "first"
        reporter.write_line(f"tests/kube: building the Kubernetes control plane ({how})")
    _build.start(background=background)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A background build is awaited outside the test's timeout (this wrapper runs first), by
    this folder's tests only: pytest calls this hook for every test of the session, and the
    others run while the build goes on."""
    if _here(item):
        _build.wait()
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A build that no test waited for (they were deselected) is let finish: the next run
    then finds the binary."""
    _build.wait()


def cluster_unavailable() -> str | None:
    """Why the cluster cannot run here (for ``pytest.skip``), or None."""
    if _build.problem:
        return _build.problem
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


@pytest.fixture(scope="module")
def kube(kube_cluster: KubeCluster) -> Iterator[Kube]:
    client = connect(kubeconfig=str(kube_cluster.kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def kubelet(kube_cluster: KubeCluster) -> KubeletClient:
    return KubeletClient(kube_cluster.state())


@pytest.fixture(scope="module")
def namespaces_made(kube: Kube) -> Iterator[list[str]]:
    """The namespaces the module's tests made: all gone when the module ends."""
    made: list[str] = []
    yield made
    wait(
        lambda: all(kube.get(NAMESPACE, name, None) is None for name in made),
        90.0,
        f"the namespace controller to remove namespaces {made}",
    )


@pytest.fixture
def namespace(kube: Kube, kubelet: KubeletClient, namespaces_made: list[str]) -> Iterator[str]:
    """A namespace of this test's own. Afterwards it is deleted (the namespace controller
    removes it and all it holds; the module waits for that at its end) and its pods at once:
    the next test starts when they and their sandboxes are gone."""
    name = f"test-{next(_numbers)}-{os.getpid()}"
    before = set(kubelet.pod_namespaces())
    kube.request("POST", NAMESPACE, None, body={"metadata": {"name": name}})
    namespaces_made.append(name)
    wait_for_default_service_account(kube, name)
    try:
        yield name
    finally:
        kube.request("DELETE", NAMESPACE, None, name)  # its controllers make no new pods
        kube.request("DELETE", POD, name)  # all its pods, each with its grace period
        wait(
            lambda: not kube.list(POD, name, "") and not set(kubelet.pod_namespaces()) - before,
            60.0,
            f"the pods of namespace {name} and their sandboxes to go",
        )


def wait(
    check: Callable[[], Any], timeout: float, what: str, details: Callable[[], str] | None = None
) -> Any:
    """Poll ``check`` (a few API reads) until it holds; fail after ``timeout`` seconds (with
    ``details()``, read then, in the message)."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        value = check()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            more = f"\n{details()}" if details is not None else ""
            pytest.fail(f"timed out after {timeout} s waiting for {what}{more}")
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)


def wait_for_default_service_account(kube: Kube, namespace: str) -> None:
    account = Kind("v1", "ServiceAccount", "serviceaccounts")
    wait(
        lambda: kube.get(account, "default", namespace) is not None,
        30.0,
        f"the default service account of {namespace}",
    )
