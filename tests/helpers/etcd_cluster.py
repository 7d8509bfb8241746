"""A private 3-member etcd cluster on loopback, for tests of member loss and quorum loss.

Each member is an :class:`~elastic_allreduce.store.EmbeddedEtcd` (same binary, command and
health check) that names the whole cluster in ``--initial-cluster``. The cluster starts and
stops as one (a context manager); single members can be SIGKILLed, SIGSTOPped, SIGCONTed and
restarted on their own data directory, where they rejoin. Everything it made -- processes,
data directories, logs -- is removed on :meth:`EtcdCluster.close`, also when starting failed.

Raft runs with etcd's default timing (100 ms heartbeat, 1 s election timeout), as a real
cluster would: a failover measured here means something outside the tests too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Final

from elastic_allreduce.errors import EtcdServerError
from elastic_allreduce.store import EmbeddedEtcd
from elastic_allreduce.store.embedded import free_ports

#: Seconds a cluster (or a restarted member) gets to report itself healthy.
START_TIMEOUT: Final = 30.0
#: Seconds one status request to a member may take (a stopped member answers nothing).
STATUS_TIMEOUT: Final = 1.0
_ADDRESS_IN_USE: Final = "address already in use"


class ClusterMember(EmbeddedEtcd):
    """One member of an :class:`EtcdCluster`: its own name, the cluster's initial member list."""

    def __init__(
        self, name: str, data_dir: Path, client_port: int, peer_port: int, cluster: str
    ) -> None:
        super().__init__(
            data_dir,
            client_port=client_port,
            peer_port=peer_port,
            fast=False,
            log_path=data_dir.with_suffix(".log"),
        )
        self.name = name
        self.cluster = cluster
        #: Whether the test SIGSTOPped it (and has not SIGCONTed it since).
        self.stopped = False

    def _member_flags(self, peer_url: str) -> list[str]:
        return [
            f"--name={self.name}",
            f"--initial-cluster={self.cluster}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=elastic-allreduce-test",
        ]

    def status(self) -> dict[str, object] | None:
        """etcd's ``/v3/maintenance/status`` of this member (its id, the leader's id, raft
        term), or None if it does not answer within STATUS_TIMEOUT."""
        return self.ask("maintenance/status", {})

    def member_id(self) -> int | None:
        """This member's raft id (None if it does not answer)."""
        status = self.status()
        header = status.get("header") if status else None
        return int(str(header["member_id"])) if isinstance(header, dict) else None

    def ask(self, path: str, payload: dict[str, object]) -> dict[str, object] | None:
        """POST ``payload`` to this member's ``/v3/<path>`` (etcd's JSON gateway); the reply,
        or None on any failure (no answer within STATUS_TIMEOUT, an error reply)."""
        request = urllib.request.Request(
            f"http://{self.endpoint}/v3/{path}",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=STATUS_TIMEOUT) as reply:  # noqa: S310
                fields = json.loads(reply.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return fields if isinstance(fields, dict) else None


class EtcdCluster:
    """Three (``size``) etcd members on 127.0.0.1, on free ports, in one temporary folder."""

    def __init__(self, size: int = 3, *, base_dir: str | Path | None = None) -> None:
        self.size = size
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="elastic-allreduce-cluster-"))
        self.members: list[ClusterMember] = []

    @property
    def endpoints_text(self) -> str:
        """Every member's client endpoint, comma-separated, as ``--etcd`` takes it."""
        return ",".join(member.endpoints_text for member in self.members)

    def start(self, timeout: float = START_TIMEOUT) -> EtcdCluster:
        """Spawn every member, then wait until each is healthy (a lone member has no quorum,
        so none can be before the others run); new ports and a fresh start after a port clash.
        EtcdServerError if it does not come up; nothing is left running then."""
        for attempt in range(1, 4):
            self._make_members()
            try:
                for member in self.members:
                    member.spawn()
                for member in self.members:
                    member.wait_healthy(timeout)
                return self
            except EtcdServerError as exc:
                self._end_members()
                if attempt == 3 or _ADDRESS_IN_USE not in str(exc):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _make_members(self) -> None:
        names = [f"m{index}" for index in range(self.size)]
        chosen = iter(free_ports(2 * len(names)))
        ports = {name: (next(chosen), next(chosen)) for name in names}
        cluster = ",".join(f"{name}=http://127.0.0.1:{ports[name][1]}" for name in names)
        for name in names:
            shutil.rmtree(self.base_dir / name, ignore_errors=True)
        self.members = [
            ClusterMember(name, self.base_dir / name, *ports[name], cluster=cluster)
            for name in names
        ]

    # -- faults --------------------------------------------------------------------------------

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the member that leads, as the running members agree; waits up to
        ``timeout`` for an election. EtcdServerError if none leads by then."""
        deadline = time.monotonic() + timeout
        while True:
            ids: dict[int, int] = {}
            leaders: set[int] = set()
            for index, member in enumerate(self.members):
                if member.pid is None or member.stopped:
                    continue
                status = member.status()
                header = status.get("header") if status else None
                if status is None or not isinstance(header, dict):
                    continue
                ids[int(str(header["member_id"]))] = index
                leaders.add(int(str(status.get("leader", 0))))
            if len(leaders) == 1:
                (leader_id,) = leaders
                if leader_id in ids:
                    return ids[leader_id]
            if time.monotonic() >= deadline:
                raise EtcdServerError(f"no member of {self.endpoints_text} leads: {leaders}")
            time.sleep(0.1)  # a poll within the deadline: raft elects within about 1 s

    def transfer_leadership(self, index: int, timeout: float = 10.0) -> None:
        """Make member ``index`` the leader (etcd's MoveLeader, asked of the current one), so
        that a test can kill the member its clients talk to and have it be the leader too."""
        deadline = time.monotonic() + timeout
        while (current := self.leader(timeout)) != index:
            target = self.members[index].member_id()
            if target is not None:
                self.members[current].ask("maintenance/transfer-leadership", {"targetID": target})
            if time.monotonic() >= deadline:
                raise EtcdServerError(f"member {index} did not take the lead within {timeout} s")

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash: its data stays for :meth:`restart`)."""
        member = self.members[index]
        member.stopped = False
        member.kill()

    def stop(self, index: int) -> None:
        """SIGSTOP member ``index``: it holds its connections open and answers nothing."""
        pid = self.members[index].pid
        if pid is None:
            raise EtcdServerError(f"member {index} does not run")
        os.kill(pid, signal.SIGSTOP)
        self.members[index].stopped = True

    def cont(self, index: int) -> None:
        """SIGCONT member ``index`` after :meth:`stop`."""
        member = self.members[index]
        if member.pid is not None and member.stopped:
            os.kill(member.pid, signal.SIGCONT)
        member.stopped = False

    def restart(self, index: int, timeout: float = START_TIMEOUT) -> None:
        """Start member ``index`` again on its data directory and ports; it rejoins the
        cluster (healthy once it follows a leader)."""
        self.members[index].restart(timeout)

    # -- cleanup -------------------------------------------------------------------------------

    def _end_members(self) -> None:
        for member in self.members:
            if member.stopped and member.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.pid, signal.SIGCONT)
            member.stopped = False
            member.kill()
            member.close()

    def close(self) -> None:
        """Kill every member and remove every folder and log the cluster made."""
        try:
            self._end_members()
        finally:
            if self._own_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
