"""Which TCP connections of a training process are Gloo's, and cutting them: the sockets a
``hvd.init()`` opened (:class:`GlooSockets`, told by the hooks) against ``/proc``."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass

log = logging.getLogger("elastic_allreduce.bootstrap")


_TCP_ESTABLISHED = "01"


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this network namespace: a row of ``/proc/net/tcp`` or ``tcp6``."""

    inode: int
    state: str
    local_port: int
    remote_port: int

    @property
    def established(self) -> bool:
        return self.state == _TCP_ESTABLISHED


def tcp_sockets() -> dict[int, TcpSocket]:
    """The TCP sockets (IPv4 and IPv6) of this process's network namespace, by inode."""
    found: dict[int, TcpSocket] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            next(handle, None)
            for line in handle:
                fields = line.split()
                if len(fields) < 10 or fields[9] == "0":  # inode 0: no longer owned
                    continue
                inode = int(fields[9])
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                found[inode] = TcpSocket(inode, fields[3], local_port, remote_port)
    return found


def own_sockets() -> dict[int, int]:
    """This process's open sockets (of any kind): inode -> one file descriptor holding it."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found.setdefault(int(target[8:-1]), int(name))
    return found


def gloo_connections(
    opened: Collection[int],
    sockets: Mapping[int, TcpSocket],
    excluded_ports: Collection[int],
    excluded_local_ports: Collection[int] = (),
) -> frozenset[int]:
    """Of the sockets ``opened`` while ``hvd.init()`` ran, the inodes of Gloo's connections:
    established TCP connections whose remote port is not one of ``excluded_ports`` (etcd, the
    launcher's rendezvous or this process's relay to it -- which Horovod's Gloo store and this
    process's threads also talk to during an init) and whose local port is not one of
    ``excluded_local_ports`` (the relay's end of Horovod's connections to it)."""
    return frozenset(
        inode
        for inode in opened
        if (tcp := sockets.get(inode)) is not None
        and tcp.established
        and tcp.remote_port not in excluded_ports
        and tcp.local_port not in excluded_local_ports
    )


class GlooSockets:
    """The TCP connections Horovod's Gloo context holds in this process, learnt at each init.

    Horovod creates Gloo's TCP devices and connects the full mesh of each context (global,
    local, cross, the global process set's) inside ``hvd.init()``: its background thread does
    it before ``initialization_done``, which ``horovod_init`` waits for. So the connections
    that appear while ``hvd.init()`` runs and are still open when it returns are Gloo's; a
    script's connections opened before or after it are not.
    :func:`elastic_allreduce.bootstrap.hooks.install` brackets every init with :meth:`begin` and
    :meth:`end`; the ring guard cuts :meth:`established`. Thread-safe.
    """

    def __init__(
        self, excluded_ports: Collection[int], excluded_local_ports: Collection[int] = ()
    ) -> None:
        self._excluded = frozenset(excluded_ports)
        self._excluded_local = frozenset(excluded_local_ports)
        self._lock = threading.Lock()
        self._inodes: frozenset[int] = frozenset()

    def begin(self) -> frozenset[int]:
        """Before ``hvd.init()``: the inodes of this process's sockets now (pass to :meth:`end`)."""
        return frozenset(own_sockets())

    def end(self, before: frozenset[int]) -> int:
        """After ``hvd.init()`` (returned or raised): remember Gloo's connections; how many.

        Those of an earlier init that are still open stay (a second ``hvd.init()`` without a
        ``shutdown()`` between connects nothing); those closed by a ``shutdown()`` drop out."""
        now = own_sockets()
        with self._lock:
            kept = self._inodes & now.keys()
            self._inodes = kept | gloo_connections(
                now.keys() - before, tcp_sockets(), self._excluded, self._excluded_local
            )
            return len(self._inodes)

    def established(self) -> tuple[dict[int, int], int]:
        """Gloo's established connections now (file descriptor -> socket inode), and how many
        other established TCP connections this process holds (the script's, etcd, rendezvous)."""
        sockets = tcp_sockets()
        with self._lock:
            gloo = self._inodes
        descriptors: dict[int, int] = {}
        others = 0
        for inode, fd in own_sockets().items():
            tcp = sockets.get(inode)
            if tcp is None or not tcp.established:
                continue
            if inode in gloo:
                descriptors[fd] = inode
            else:
                others += 1
        return descriptors, others


def shutdown_sockets(descriptors: Mapping[int, int]) -> int:
    """shutdown(2) each socket (file descriptor -> the inode it held when listed); return how
    many. The descriptors stay open for their owner. One that holds another socket by now is
    left alone: Horovod may have closed it meanwhile and the number been reused (its HTTP
    store's request, the relay's connection)."""
    done = 0
    for fd, inode in descriptors.items():
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                if os.fstat(sock.fileno()).st_ino != inode:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            finally:
                sock.close()
    return done
