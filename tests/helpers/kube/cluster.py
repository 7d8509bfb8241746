"""A private Kubernetes control plane on this machine, for the tests and for people.

What runs (all from one binary, ``build/kube/bin/kube-control-plane``, built by ``make
kube-build`` from tools/kube; docs/kubernetes.md, "A real control plane in the tests"):

- etcd (no TLS: it listens on the control plane namespace's own 127.0.0.1 only),
- kube-apiserver on 10.233.0.1:6443 (TLS, RBAC and Node authorization, the default admission
  chain with PodSecurity and ValidatingAdmissionPolicy, service-account tokens),
- kube-scheduler and kube-controller-manager (every default controller),
- a forwarder (:mod:`tests.helpers.kube.forward`) that listens on 127.0.0.1:<free port> in the
  root namespace and connects to the API server from inside the control plane's namespace,
- with ``nodes`` > 0, the process kubelet (``tests.helpers.kube.kubelet``), which registers the
  nodes and runs their pods on the cluster's bridge.

The network (the root namespace gets no interface, address or route)::

    <prefix>-br   the bridge br0 and the bridge-side veth ends (the kubelet adds its pods' ends)
    <prefix>-cp   the control plane's host: lo, and eth0 (veth into br0) with 10.233.0.1/16

``<prefix>`` is ``eakube-<pid>-<n>``: the creating process and a counter. Every cluster may use
10.233.0.0/16, since its namespaces are isolated from every other's. ``DIR/state.json`` holds
everything another process needs (the kubelet, ``down``): see :meth:`KubeCluster.state`.

Use it as a context manager (``with KubeCluster(tmp) as cluster``), or from the command line:
``python -m tests.helpers.kube.cluster up [--nodes N] [--gpus-per-node G] [--dir DIR]``, which
leaves the cluster running in the background, ``down [--dir DIR]`` and ``status [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import logging
import os
import re
import select
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import yaml

from tests.helpers import testhosts
from tests.helpers.kube import forward
from tests.helpers.kube.pki import ClusterPki, KeyPair

log = logging.getLogger(__name__)

ROOT: Final = Path(__file__).resolve().parents[3]
#: Where ``make kube-up`` keeps its cluster (and ``make kube-build`` the binary).
DEFAULT_DIR: Final = ROOT / "build" / "kube"
BINARY: Final = DEFAULT_DIR / "bin" / "kube-control-plane"
KUBECTL: Final = DEFAULT_DIR / "bin" / "kubectl"

#: Every namespace of a cluster is named ``<PREFIX>-<pid>-<n>-<role>``.
PREFIX: Final = "eakube"
_NAME: Final = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-")
BRIDGE: Final = "br0"
SUBNET: Final = "10.233.0.0/16"
APISERVER_ADDRESS: Final = "10.233.0.1"
APISERVER_PORT: Final = 6443
SERVICE_CIDR: Final = "10.0.0.0/24"
SERVICE_IP: Final = "10.0.0.1"  # the `kubernetes` Service: the range's first address
ETCD_PORT: Final = 2379
SCHEDULER_PORT: Final = 10259
CONTROLLER_MANAGER_PORT: Final = 10257
ISSUER: Final = "https://kubernetes.default.svc.cluster.local"
#: The control plane's interface in its namespace, and its veth end on the bridge.
CP_IFACE: Final = "eth0"
CP_PORT: Final = "cp0"

#: Names under which state.json lists the processes, in the order ``down`` stops them.
STOP_ORDER: Final = (
    "kubelet",
    "kube-controller-manager",
    "kube-scheduler",
    "kube-apiserver",
    "etcd",
    "forward",
)
#: Seconds the kubelet gets to stop its pods after SIGTERM, and the others to exit.
KUBELET_STOP_TIMEOUT: Final = 120.0
STOP_TIMEOUT: Final = 15.0
LOG_TAIL_LINES: Final = 40


class KubeClusterError(RuntimeError):
    """The cluster could not be started, reached or stopped (the message says why)."""


# -- processes ---------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot), to tell it from a reused pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 else None


@dataclass
class _Process:
    """A process of the cluster: started here (``popen``) or read back from state.json."""

    name: str
    pid: int
    ticks: int | None
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return testhosts.process_running(self.pid) and _start_ticks(self.pid) == self.ticks

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to end; whether it did."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float) -> bool:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; whether it is gone."""
        self.signal(signal.SIGTERM)
        if self.wait(timeout):
            return True
        self.signal(signal.SIGKILL)
        return self.wait(5.0)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (or why there are none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(the log is empty)"


# -- HTTPS ------------------------------------------------------------------------------------


def _get(
    host: str,
    port: int,
    path: str,
    context: ssl.SSLContext | None,
    timeout: float = 5.0,
) -> tuple[int, bytes]:
    """GET ``path`` (HTTPS with ``context``, else HTTP); the status and body."""
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(host, port, context=context, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _insecure_context() -> ssl.SSLContext:
    """For the scheduler's and controller manager's self-signed health endpoints."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


# -- namespaces --------------------------------------------------------------------------------


def _namespaces_of(prefix: str) -> list[str]:
    try:
        names = testhosts.all_namespaces()
    except testhosts.TestHostsError:
        return []
    return [name for name in names if name.startswith(f"{prefix}-")]


def remove_stale() -> list[str]:
    """Delete the namespaces of clusters whose creating process is gone and in which nothing
    runs any more (a cluster that ``up`` left running has a dead creator but a live control
    plane: it stays until ``down``). Returns the names removed."""
    groups: dict[str, list[str]] = {}
    try:
        names = testhosts.all_namespaces()
    except testhosts.TestHostsError:
        return []
    for name in names:
        match = _NAME.match(name)
        if match is not None:
            groups.setdefault(f"{PREFIX}-{match.group(1)}-{match.group(2)}", []).append(name)
    removed: list[str] = []
    for prefix, members in groups.items():
        creator = int(prefix.split("-")[1])
        if testhosts.process_running(creator):
            continue
        with contextlib.suppress(testhosts.TestHostsError):
            if any(testhosts.namespace_pids(ns) for ns in members):
                continue
        for ns in sorted(members, key=lambda n: n.endswith("-br")):  # the bridge last
            with contextlib.suppress(testhosts.TestHostsError):
                testhosts.kill_namespace(ns)
                removed.append(ns)
            shutil.rmtree(testhosts.NETNS_ETC / ns, ignore_errors=True)
    return removed


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below ``directory`` in this process's mount namespace."""
    base = str(directory.resolve())
    found: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == base or point.startswith(base + "/"):
                found.append(point)
    return found


# -- the cluster -------------------------------------------------------------------------------


def _kubeconfig(path: Path, server: str, ca: Path, client: KeyPair, user: str) -> None:
    def data(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "eakube",
                "cluster": {"server": server, "certificate-authority-data": data(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": data(client.cert),
                    "client-key-data": data(client.key),
                },
            }
        ],
        "contexts": [{"name": user, "context": {"cluster": "eakube", "user": user}}],
        "current-context": user,
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        yaml.safe_dump(config, out, sort_keys=False)


def missing_binary_reason() -> str | None:
    """None when the control plane's binary is built, else what to do."""
    if BINARY.is_file() and os.access(BINARY, os.X_OK):
        return None
    return f"the control plane's binary {BINARY} is missing: run `make kube-build` (needs Go)"


class KubeCluster:
    """A private control plane (and, with ``nodes`` > 0, the process kubelet's nodes).

    ``start()`` refuses (:class:`KubeClusterError`) when the binary is missing, when not run
    as root, or when a cluster already runs in ``directory``; a start that fails stops what
    it started and raises one error quoting the failing component's log. ``close()`` stops the
    kubelet first (SIGTERM: it stops its pods and removes their namespaces), then the control
    plane and the forwarder, then deletes every namespace of the cluster."""

    _counter = 0

    def __init__(
        self,
        directory: Path = DEFAULT_DIR,
        *,
        nodes: int = 0,
        gpus_per_node: int = 0,
        volumes: int = 6,
        timeout: float = 120.0,
    ) -> None:
        if nodes < 0 or gpus_per_node < 0 or volumes < 0:
            raise ValueError("nodes, gpus_per_node and volumes must not be negative")
        self.directory = directory.resolve()
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.volumes = volumes
        self.timeout = timeout
        KubeCluster._counter += 1
        self.prefix = f"{PREFIX}-{os.getpid()}-{KubeCluster._counter}"
        self.bridge_namespace = f"{self.prefix}-br"
        self.cp_namespace = f"{self.prefix}-cp"
        self.processes: dict[str, _Process] = {}
        self.forward_port: int | None = None
        self.started: float | None = None
        self.startup_seconds: float | None = None
        self._made: list[str] = []
        self._context: ssl.SSLContext | None = None

    # -- paths -------------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.directory / "state.json"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (https://127.0.0.1:<forward port>), for the root namespace."""
        return self.directory / "kubeconfig"

    @property
    def in_cluster_kubeconfig(self) -> Path:
        """The admin kubeconfig for processes in the cluster's namespaces (10.233.0.1:6443)."""
        return self.directory / "kubeconfig-in-cluster"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.directory / "kubelet.kubeconfig"

    @property
    def pki(self) -> Path:
        return self.directory / "pki"

    @property
    def ca_cert(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    @property
    def server(self) -> str:
        if self.forward_port is None:
            raise KubeClusterError("the cluster has not been started")
        return f"https://127.0.0.1:{self.forward_port}"

    def state(self) -> dict[str, Any]:
        """What state.json holds: the contract with the kubelet and with ``down``."""
        return {
            "dir": str(self.directory),
            "prefix": self.prefix,
            "bridge_namespace": self.bridge_namespace,
            "bridge": BRIDGE,
            "cp_namespace": self.cp_namespace,
            "subnet": SUBNET,
            "apiserver_address": APISERVER_ADDRESS,
            "apiserver_port": APISERVER_PORT,
            "server": f"https://127.0.0.1:{self.forward_port}" if self.forward_port else None,
            "kubeconfig": str(self.kubeconfig),
            "in_cluster_kubeconfig": str(self.in_cluster_kubeconfig),
            "kubelet_kubeconfig": str(self.kubelet_kubeconfig),
            "ca_cert": str(self.ca_cert),
            "service_cidr": SERVICE_CIDR,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "pids": {name: proc.pid for name, proc in self.processes.items()},
            "start_ticks": {name: proc.ticks for name, proc in self.processes.items()},
            "logs": {name: str(proc.log) for name, proc in self.processes.items()},
            "namespaces": list(self._made),
            "started": self.started,
            "startup_seconds": self.startup_seconds,
        }

    def _write_state(self) -> None:
        temporary = self.state_file.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.state(), indent=2) + "\n")
        temporary.replace(self.state_file)

    # -- reading a running cluster back ------------------------------------------------------

    @classmethod
    def attach(cls, directory: Path = DEFAULT_DIR) -> KubeCluster:
        """The cluster that state.json in ``directory`` describes (to stop or inspect it)."""
        state_file = directory.resolve() / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError) as exc:
            raise KubeClusterError(f"no cluster state in {state_file}: {exc}") from exc
        cluster = cls(Path(state["dir"]), nodes=int(state.get("nodes") or 0))
        cluster.prefix = state["prefix"]
        cluster.bridge_namespace = state["bridge_namespace"]
        cluster.cp_namespace = state["cp_namespace"]
        server = state.get("server")
        cluster.forward_port = int(server.rsplit(":", 1)[1]) if server else None
        cluster.started = state.get("started")
        cluster.startup_seconds = state.get("startup_seconds")
        cluster._made = list(state.get("namespaces") or [])
        ticks = state.get("start_ticks") or {}
        logs = state.get("logs") or {}
        for name, pid in (state.get("pids") or {}).items():
            log = Path(logs.get(name, cluster.logs / f"{name}.log"))
            cluster.processes[name] = _Process(name, int(pid), ticks.get(name), log)
        return cluster

    def running(self) -> list[str]:
        """The names of the cluster's processes that still run."""
        return [name for name, proc in self.processes.items() if proc.alive()]

    # -- start -------------------------------------------------------------------------------

    def _refuse_if_unusable(self) -> None:
        reason = missing_binary_reason()
        if reason is not None:
            raise KubeClusterError(reason)
        if os.geteuid() != 0:
            raise KubeClusterError(
                f"the test cluster needs root (network namespaces; this process runs as uid "
                f"{os.geteuid()}): run it as root"
            )
        if shutil.which("ip") is None:
            raise KubeClusterError("the `ip` command (iproute2) is not installed")
        if self.nodes and not (ROOT / "tests" / "helpers" / "kube" / "kubelet.py").is_file():
            raise KubeClusterError(
                "nodes were asked for but the process kubelet (tests/helpers/kube/kubelet.py) "
                "is missing: start the cluster with --nodes 0"
            )
        if self.state_file.exists():
            try:
                other = KubeCluster.attach(self.directory)
            except (KubeClusterError, KeyError, TypeError, ValueError):
                return  # unreadable: nothing of it can be stopped through it anyway
            alive = other.running()
            if alive:
                pids = {name: other.processes[name].pid for name in alive}
                raise KubeClusterError(
                    f"a cluster already runs in {self.directory} ({other.prefix}, processes "
                    f"{pids}): stop it first (`make kube-down`, or `python -m "
                    f"tests.helpers.kube.cluster down --dir {self.directory}`)"
                )
            other.close()  # what a dead cluster left: its namespaces, its state file

    def start(self) -> KubeCluster:
        """Start everything and wait until the API is ready (and the nodes, if any, Ready)."""
        if self.started is not None:
            raise KubeClusterError(f"cluster {self.prefix} was already started")
        self._refuse_if_unusable()
        began = time.monotonic()
        self.started = time.time()
        remove_stale()
        for stale in ("pki", "etcd", "logs", "volumes"):
            shutil.rmtree(self.directory / stale, ignore_errors=True)
        self.logs.mkdir(parents=True)
        try:
            self._make_network()
            self._write_state()
            self._start_forwarder()
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            self._start_controllers()
            self._make_volumes()
            self._write_state()
            if self.nodes:
                self._start_kubelet()
        except BaseException:
            with contextlib.suppress(KubeClusterError):
                self.close()
            raise
        self.startup_seconds = time.monotonic() - began
        self._write_state()
        return self

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _wait(self, ready: Callable[[], bool], what: str, watched: Sequence[str]) -> None:
        """Poll ``ready`` until it holds; raise when a watched process exits or the start
        timeout passes (quoting the log of the process concerned)."""
        deadline = self._deadline()
        delay = 0.02
        while True:
            for name in watched:
                proc = self.processes[name]
                if not proc.alive():
                    code = proc.popen.returncode if proc.popen is not None else "?"
                    raise KubeClusterError(
                        f"{name} exited (code {code}) while waiting for {what}; the end of "
                        f"{proc.log}:\n{log_tail(proc.log)}"
                    )
            try:
                if ready():
                    return
            except (OSError, http.client.HTTPException, forward.NamespaceError, TimeoutError):
                pass  # not listening yet
            if time.monotonic() >= deadline:
                logs = "\n".join(
                    f"--- the end of {self.processes[n].log}:\n{log_tail(self.processes[n].log)}"
                    for n in watched
                )
                raise KubeClusterError(
                    f"timed out after {self.timeout} s waiting for {what}\n{logs}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _make_network(self) -> None:
        ip = testhosts._ip
        for ns in (self.bridge_namespace, self.cp_namespace):
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.bridge_namespace, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.bridge_namespace, "link", "set", BRIDGE, "up")
        # Made inside the control plane's namespace, its peer moved to the bridge's at once.
        ip(
            *("-n", self.cp_namespace, "link", "add", CP_IFACE, "type", "veth"),
            *("peer", "name", CP_PORT, "netns", self.bridge_namespace),
        )
        ip("-n", self.bridge_namespace, "link", "set", CP_PORT, "master", BRIDGE, "up")
        ip("-n", self.cp_namespace, "addr", "add", f"{APISERVER_ADDRESS}/16", "dev", CP_IFACE)
        ip("-n", self.cp_namespace, "link", "set", CP_IFACE, "up")

        def carrier() -> bool:
            (link,) = testhosts._ip_json("-n", self.cp_namespace, "link", "show", "dev", CP_IFACE)
            return "LOWER_UP" in link["flags"]

        testhosts._wait_until(carrier, 10.0, f"{CP_IFACE} in {self.cp_namespace} to come up")

    def _spawn(self, name: str, argv: Sequence[str], *, pass_fds: Sequence[int] = ()) -> _Process:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives `up`, and a Ctrl-C in its terminal
                pass_fds=tuple(pass_fds),
                cwd=ROOT,  # `python -m tests.helpers...` finds its package
            )
        proc = _Process(name, popen.pid, _start_ticks(popen.pid), log, popen)
        self.processes[name] = proc
        return proc

    def _in_cp(self, name: str, argv: Sequence[str]) -> _Process:
        """Start a control plane component in its namespace (``ip netns exec`` execs it)."""
        return self._spawn(name, ["ip", "netns", "exec", self.cp_namespace, str(BINARY), *argv])

    def _start_forwarder(self) -> None:
        _, self.forward_port = self._forward(
            "forward",
            ("--listen", "127.0.0.1:0"),
            ("--connect-netns", self.cp_namespace),
            ("--connect", f"{APISERVER_ADDRESS}:{APISERVER_PORT}"),
        )

    def expose_to_pods(self, name: str, port: int) -> tuple[str, _Process]:
        """Make ``127.0.0.1:port`` of the root namespace (a test's etcd) reachable from the
        pods, at ``<the control plane's address>:<a free port>``: that endpoint, and the
        forwarder's process (stop it with ``.stop(timeout)``; ``close()`` stops it too)."""
        proc, forwarded = self._forward(
            name,
            ("--listen-netns", self.cp_namespace),
            ("--listen", f"{APISERVER_ADDRESS}:0"),
            ("--connect", f"127.0.0.1:{port}"),
        )
        return f"{APISERVER_ADDRESS}:{forwarded}", proc

    def _forward(self, name: str, *flags: tuple[str, str]) -> tuple[_Process, int]:
        """Start a forwarder (tests.helpers.kube.forward) with these flags; its process and
        the port it listens on, once it does."""
        read_end, write_end = os.pipe()
        try:
            proc = self._spawn(
                name,
                [
                    sys.executable,
                    *("-m", "tests.helpers.kube.forward"),
                    *(part for flag in flags for part in flag),
                    *("--ready-fd", str(write_end)),
                ],
                pass_fds=[write_end],
            )
            os.close(write_end)
            write_end = -1
            text = b""
            deadline = self._deadline()
            while not text.endswith(b"\n"):  # the port, or end of file if it died
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([read_end], [], [], remaining)[0]:
                    raise KubeClusterError(f"the forwarder did not start in {self.timeout} s")
                chunk = os.read(read_end, 64)
                if not chunk:
                    proc.wait(5.0)
                    raise KubeClusterError(
                        f"the forwarder exited before it listened; the end of {proc.log}:\n"
                        f"{log_tail(proc.log)}"
                    )
                text += chunk
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        return proc, int(text)

    def _make_pki(self) -> None:
        pki = ClusterPki(self.pki)
        apiserver = pki.server(
            "apiserver",
            "kube-apiserver",
            dns=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ips=["127.0.0.1", APISERVER_ADDRESS, SERVICE_IP],
        )
        admin = pki.client("admin", "kubernetes-admin", ["system:masters"])
        scheduler = pki.client("kube-scheduler", "system:kube-scheduler")
        controller_manager = pki.client("kube-controller-manager", "system:kube-controller-manager")
        # One process plays every node, which the Node authorizer cannot admit (it ties each
        # system:node:<name> to its own objects): the kubelet is an administrator of its own.
        kubelet = pki.client("kubelet", "eakube:process-kubelet", ["system:masters"])
        self._sa = pki.service_account_keys()
        self._apiserver_cert = apiserver
        inside = f"https://{APISERVER_ADDRESS}:{APISERVER_PORT}"
        _kubeconfig(self.kubeconfig, self.server, pki.ca.cert, admin, "admin")
        _kubeconfig(self.in_cluster_kubeconfig, inside, pki.ca.cert, admin, "admin")
        _kubeconfig(self.kubelet_kubeconfig, self.server, pki.ca.cert, kubelet, "kubelet")
        _kubeconfig(self.pki / "scheduler.kubeconfig", inside, pki.ca.cert, scheduler, "scheduler")
        _kubeconfig(
            self.pki / "controller-manager.kubeconfig",
            inside,
            pki.ca.cert,
            controller_manager,
            "controller-manager",
        )
        context = ssl.create_default_context(cafile=str(pki.ca.cert))
        context.load_cert_chain(str(admin.cert), str(admin.key))
        self._context = context

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{ETCD_PORT}"
        peer = f"http://127.0.0.1:{ETCD_PORT + 1}"
        self._in_cp(
            "etcd",
            [
                "etcd",
                *("--name", "eakube"),
                *("--data-dir", str(self.directory / "etcd")),
                *("--listen-client-urls", client, "--advertise-client-urls", client),
                *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
                *("--initial-cluster", f"eakube={peer}"),
                # A throwaway cluster: no fsync, and a fast first election.
                *("--unsafe-no-fsync", "--heartbeat-interval", "10", "--election-timeout", "100"),
                *("--log-level", "warn"),
            ],
        )

        def healthy() -> bool:
            status, body = forward.call_in_netns(
                self.cp_namespace, lambda: _get("127.0.0.1", ETCD_PORT, "/health", None)
            )
            return status == 200 and b'"health":"true"' in body.replace(b" ", b"")

        self._wait(healthy, "etcd to be healthy", ["etcd"])

    def _start_apiserver(self) -> None:
        pki = self.pki
        self._in_cp(
            "kube-apiserver",
            [
                "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
                f"--bind-address={APISERVER_ADDRESS}",
                f"--advertise-address={APISERVER_ADDRESS}",
                f"--secure-port={APISERVER_PORT}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={self._apiserver_cert.cert}",
                f"--tls-private-key-file={self._apiserver_cert.key}",
                f"--client-ca-file={self.ca_cert}",
                "--authorization-mode=Node,RBAC",
                # The default chain plus these (PodSecurity and ValidatingAdmissionPolicy are
                # default-on in 1.37: named so that a changed default cannot drop them).
                "--enable-admission-plugins=NodeRestriction,PodSecurity,ValidatingAdmissionPolicy",
                f"--service-account-issuer={ISSUER}",
                f"--service-account-key-file={self._sa.cert}",
                f"--service-account-signing-key-file={self._sa.key}",
                f"--api-audiences={ISSUER}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Privileged pods are up to Pod Security Admission (namespace labels), as on
                # most clusters: the tests show that `restricted` refuses them.
                "--allow-privileged=true",
                "--profiling=false",
            ],
        )
        self._wait(self.api_ready, "the API server's /readyz", ["kube-apiserver", "forward"])

    def api_ready(self) -> bool:
        """Whether the API server answers ``/readyz`` with ok (through the forwarder)."""
        status, body = self.request("GET", "/readyz", timeout=5.0)
        return status == 200 and body.strip() == b"ok"

    def _start_controllers(self) -> None:
        common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false"]
        scheduler_kubeconfig = self.pki / "scheduler.kubeconfig"
        self._in_cp(
            "kube-scheduler",
            [
                "kube-scheduler",
                f"--kubeconfig={scheduler_kubeconfig}",
                f"--authentication-kubeconfig={scheduler_kubeconfig}",
                f"--authorization-kubeconfig={scheduler_kubeconfig}",
                *common,
            ],
        )
        cm_kubeconfig = self.pki / "controller-manager.kubeconfig"
        self._in_cp(
            "kube-controller-manager",
            [
                "kube-controller-manager",
                f"--kubeconfig={cm_kubeconfig}",
                f"--authentication-kubeconfig={cm_kubeconfig}",
                f"--authorization-kubeconfig={cm_kubeconfig}",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self._sa.key}",
                f"--root-ca-file={self.ca_cert}",
                f"--cluster-signing-cert-file={self.ca_cert}",
                f"--cluster-signing-key-file={self.pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=eakube",
                *common,
            ],
        )
        insecure = _insecure_context()
        for name, port in (
            ("kube-scheduler", SCHEDULER_PORT),
            ("kube-controller-manager", CONTROLLER_MANAGER_PORT),
        ):

            def healthy(port: int = port) -> bool:
                status, body = forward.call_in_netns(
                    self.cp_namespace, lambda: _get("127.0.0.1", port, "/healthz", insecure)
                )
                return status == 200 and body.strip() == b"ok"

            self._wait(healthy, f"{name}'s /healthz", [name, "kube-apiserver"])
        # Pods need their namespace's service account: wait until the controllers made one.
        self._wait(
            lambda: (
                self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
            ),
            "the default service account",
            ["kube-controller-manager"],
        )

    def _make_volumes(self) -> None:
        """PersistentVolumes for the shipped claims (they name no storage class, and the
        cluster has no default one)."""
        for number in range(1, self.volumes + 1):
            path = self.directory / "volumes" / f"pv-{number}"
            path.mkdir(parents=True)
            path.chmod(0o777)  # the pods run as non-root users
            status, body = self.request(
                "POST",
                "/api/v1/persistentvolumes",
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolume",
                    "metadata": {"name": f"pv-{number}", "labels": {"eakube/volume": "hostpath"}},
                    "spec": {
                        "capacity": {"storage": "20Gi"},
                        "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                        "persistentVolumeReclaimPolicy": "Retain",
                        "hostPath": {"path": str(path), "type": "Directory"},
                    },
                },
            )
            if status != 201:
                raise KubeClusterError(f"creating PersistentVolume pv-{number}: {status} {body!r}")

    def recycle_volumes(self) -> list[str]:
        """Make Released volumes Available again (their claims were deleted; Retain keeps
        them bound to the gone claim): empty their folders and drop the claim reference."""
        status, body = self.request("GET", "/api/v1/persistentvolumes?labelSelector=eakube/volume")
        if status != 200:
            raise KubeClusterError(f"listing PersistentVolumes: {status} {body!r}")
        recycled: list[str] = []
        for volume in json.loads(body)["items"]:
            if volume.get("status", {}).get("phase") != "Released":
                continue
            name = volume["metadata"]["name"]
            folder = Path(volume["spec"]["hostPath"]["path"])
            for entry in folder.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            patch = [{"op": "remove", "path": "/spec/claimRef"}]
            status, body = self.request(
                "PATCH", f"/api/v1/persistentvolumes/{name}", patch, "application/json-patch+json"
            )
            if status != 200:
                raise KubeClusterError(f"recycling PersistentVolume {name}: {status} {body!r}")
            recycled.append(name)
        return recycled

    def _start_kubelet(self) -> None:
        argv = [
            sys.executable,
            *("-m", "tests.helpers.kube.kubelet"),
            *("--state", str(self.state_file)),
            *("--nodes", str(self.nodes)),
        ]
        if self.gpus_per_node:
            argv += ["--gpus-per-node", str(self.gpus_per_node)]
        self._spawn("kubelet", argv)
        self._write_state()
        self._wait(
            lambda: len(self.ready_nodes()) >= self.nodes,
            f"{self.nodes} Ready nodes",
            ["kubelet", "kube-apiserver"],
        )

    # -- using it ----------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> tuple[int, bytes]:
        """One API request as the admin (through the forwarder): the status and body."""
        if self.forward_port is None:
            raise KubeClusterError("the cluster has not been started")
        if self._context is None:
            context = ssl.create_default_context(cafile=str(self.ca_cert))
            context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
            self._context = context
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.forward_port, context=self._context, timeout=timeout
        )
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": content_type} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def ready_nodes(self) -> list[str]:
        """The names of the nodes whose Ready condition is True."""
        status, body = self.request("GET", "/api/v1/nodes")
        if status != 200:
            return []
        ready: list[str] = []
        for node in json.loads(body)["items"]:
            conditions = node.get("status", {}).get("conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
                ready.append(node["metadata"]["name"])
        return ready

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        timeout: float = 60.0,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl --kubeconfig <admin> ARGS`` (from the root namespace)."""
        argv = [str(KUBECTL), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        done = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise KubeClusterError(
                f"`kubectl {' '.join(args)}` exited with {done.returncode}:\n"
                f"{done.stdout}{done.stderr}"
            )
        return done

    # -- stop --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the kubelet (SIGTERM, it removes its pods), then the control plane and the
        forwarder, then delete the cluster's namespaces. Idempotent; raises
        :class:`KubeClusterError` listing what could not be removed, after trying all of it."""
        problems: list[str] = []
        extra = [name for name in self.processes if name not in STOP_ORDER]  # expose_to_pods'
        for name in [*extra, *STOP_ORDER]:
            proc = self.processes.get(name)
            if proc is None:
                continue
            timeout = KUBELET_STOP_TIMEOUT if name == "kubelet" else STOP_TIMEOUT
            if not proc.stop(timeout):
                problems.append(f"{name} (pid {proc.pid}) did not exit")
        for ns in sorted(
            set(self._made) | set(_namespaces_of(self.prefix)),
            key=lambda n: (n == self.bridge_namespace, n == self.cp_namespace),
        ):  # pods' namespaces first, the bridge's last
            try:
                testhosts.kill_namespace(ns)
            except testhosts.TestHostsError as exc:
                problems.append(str(exc))
            shutil.rmtree(testhosts.NETNS_ETC / ns, ignore_errors=True)
        for point in mounts_under(self.directory):
            problems.append(f"mount left at {point}")
        left = _namespaces_of(self.prefix)
        if left:
            problems.append(f"namespaces still present: {left}")
        if not problems:
            with contextlib.suppress(FileNotFoundError):
                self.state_file.unlink()
        self._made.clear()
        if problems:
            raise KubeClusterError(f"stopping cluster {self.prefix}: " + "; ".join(problems))

    def __enter__(self) -> KubeCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except KubeClusterError:  # do not hide the body's exception behind the cleanup's
            log.exception("stopping cluster %s after %s failed", self.prefix, exc_type.__name__)


# -- command line ------------------------------------------------------------------------------


def _up(args: argparse.Namespace) -> int:
    cluster = KubeCluster(
        args.dir,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        volumes=args.volumes,
        timeout=args.timeout,
    )
    cluster.start()
    nodes = f", {args.nodes} nodes Ready" if args.nodes else ""
    print(
        f"cluster {cluster.prefix} up in {cluster.startup_seconds:.1f} s (API ready{nodes}); "
        f"server {cluster.server}\n"
        f"  kubectl: {KUBECTL} --kubeconfig {cluster.kubeconfig} get nodes\n"
        f"  state: {cluster.state_file}; logs: {cluster.logs}/\n"
        f"  stop it with `make kube-down`"
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    if not (args.dir.resolve() / "state.json").exists():
        print(f"no cluster in {args.dir} (no state.json): nothing to stop")
        return 0
    cluster = KubeCluster.attach(args.dir)
    cluster.close()
    print(f"cluster {cluster.prefix} stopped: no process, namespace or mount left")
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = KubeCluster.attach(args.dir)
    running = cluster.running()
    print(f"cluster {cluster.prefix} in {cluster.directory}, server {cluster.state()['server']}")
    for name, proc in cluster.processes.items():
        print(f"  {name:<24} pid {proc.pid:<8} {'running' if name in running else 'NOT running'}")
    try:
        ready = cluster.api_ready()
    except (OSError, http.client.HTTPException, KubeClusterError) as exc:
        print(f"  API: unreachable ({exc})")
        return 1
    print(f"  API /readyz: {'ok' if ready else 'not ready'}; Ready nodes: {cluster.ready_nodes()}")
    return 0 if ready and len(running) == len(cluster.processes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.helpers.kube.cluster",
        description="A private Kubernetes control plane on this machine (docs/kubernetes.md).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start a cluster and leave it running")
    up.add_argument("--nodes", type=int, default=2, help="process kubelet nodes (0: none)")
    up.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per node")
    up.add_argument("--volumes", type=int, default=6, help="hostPath PersistentVolumes")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds for each start step")
    for command in (up, commands.add_parser("down", help="stop the cluster")):
        command.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="default build/kube")
    commands.add_parser("status", help="what runs").add_argument(
        "--dir", type=Path, default=DEFAULT_DIR
    )
    args = parser.parse_args(argv)
    handlers = {"up": _up, "down": _down, "status": _status}
    try:
        return handlers[args.command](args)
    except KubeClusterError as exc:
        print(f"kube {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
