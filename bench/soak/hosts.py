"""Where the soak's jobs run: this process inside a test host's network namespace (where the
etcd cluster listens), and the 3-member etcd cluster on host 0's address, which the worker
hosts reach and the etcd faults stop, kill and restart."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from elastic_allreduce.store.embedded import free_port
from tests.helpers.etcd_cluster import START_TIMEOUT, ClusterMember, EtcdCluster
from tests.helpers.testhosts import Host

CLONE_NEWNET: Final = 0x40000000

# -- this process in a test host's network namespace -------------------------------------------


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET): {os.strerror(errno)}")


@contextlib.contextmanager
def inside(host: Host) -> Iterator[None]:
    """Run this process's main thread -- and the threads and children it starts meanwhile -- in
    ``host``'s network namespace, where the etcd cluster listens; back in its own after, so
    that the test hosts' cleanup (which kills every process in their namespaces) spares it."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{host.ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


# -- the etcd cluster on host 0 ----------------------------------------------------------------


class _Member(ClusterMember):
    """A cluster member on a test host's address (worker hosts reach it), not loopback."""

    def __init__(
        self, address: str, name: str, data_dir: Path, ports: tuple[int, int], cluster: str
    ) -> None:
        super().__init__(name, data_dir, ports[0], ports[1], cluster)
        self.host = address


class HostEtcd(EtcdCluster):
    """tests/helpers/etcd_cluster.py's 3 members, on one test host's address."""

    def __init__(self, address: str, base_dir: Path) -> None:
        super().__init__(3, base_dir=base_dir)
        self.address = address

    def _make_members(self) -> None:
        names = [f"m{index}" for index in range(self.size)]
        ports = {name: (free_port(self.address), free_port(self.address)) for name in names}
        cluster = ",".join(f"{n}=http://{self.address}:{ports[n][1]}" for n in names)
        for name in names:
            shutil.rmtree(self.base_dir / name, ignore_errors=True)
        self.members = [
            _Member(self.address, name, self.base_dir / name, ports[name], cluster)
            for name in names
        ]

    def whole(self) -> bool:
        """Whether every member runs, answers, and all follow one leader."""
        leaders = set()
        for member in self.members:
            status = None if member.pid is None or member.stopped else member.status()
            if status is None:
                return False
            leaders.add(str(status.get("leader", "0")))
        return len(leaders) == 1 and "0" not in leaders

    def restart_all(self) -> None:
        """Stop every member (SIGTERM), start them all again, wait until each is healthy."""
        for member in self.members:
            member.stop()
        for member in self.members:
            member.spawn()
        for member in self.members:
            member.wait_healthy(START_TIMEOUT)
