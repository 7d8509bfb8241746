"""Worker nodes as local agent processes (``elastic-run`` without a cluster).

With a private etcd (``elastic-run`` without ``--etcd``) the agents die with the launcher, as
the store they need does. With a shared etcd they outlive it: a launcher SIGKILLed or OOM-killed
leaves its nodes training, and the same command run again adopts them (:meth:`adopt`) -- or,
if no launcher comes back, each agent leaves after the leaderless grace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from elastic_allreduce._process import die_with_parent
from elastic_allreduce.records.values import MemberRecord
from launcher.provisioners.api import Provisioner
from launcher.vocabulary import NodeTemplate

#: The ids this provisioner gives its nodes: ``n0``, ``n1``, ...
_NODE_ID = re.compile(r"n(\d+)")


class LocalProvisioner(Provisioner):
    """Runs each node as ``python -m launcher.node.agent`` on this machine (output inherited)."""

    def __init__(self, template: NodeTemplate, *, outlive_launcher: bool = False) -> None:
        self._template = template
        self._outlive = outlive_launcher
        self._numbers = itertools.count()
        self._agents: dict[str, subprocess.Popen[bytes]] = {}
        #: Agents of a previous launcher of this job, taken over by :meth:`adopt`: node -> pid.
        self._adopted: dict[str, int] = {}

    def start_nodes(self, count: int) -> list[str]:
        started = []
        for _ in range(count):
            node_id = f"n{next(self._numbers)}"
            settings = dataclasses.replace(self._template.for_node(node_id), provisioned=True)
            payload = json.dumps(dataclasses.asdict(settings))
            # Own session: the launcher, not the terminal's Ctrl-C, decides when agents stop.
            # With a private etcd an agent dies with the launcher even when it is SIGKILLed.
            self._agents[node_id] = subprocess.Popen(
                [sys.executable, "-m", "launcher.node.agent", payload],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=None if self._outlive else die_with_parent,  # noqa: PLW1509 - prctl
            )
            started.append(node_id)
        return started

    def adopt(self, members: Mapping[str, MemberRecord]) -> frozenset[str]:
        """Take over the agents a previous launcher of this job started on this machine: stop
        them like its own later, and never reuse their node ids. Their node ids."""
        taken = [int(m.group(1)) for node in members if (m := _NODE_ID.fullmatch(node))]
        if taken:
            self._numbers = itertools.count(max(taken) + 1)
        for node, member in members.items():
            if member.pid is not None and _is_agent(member.pid, self._template.job_id, node):
                self._adopted[node] = member.pid
        return frozenset(self._adopted)

    def stop_node(self, node_id: str) -> None:
        agent = self._agents.get(node_id)
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        pid = self._adopted.get(node_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def close(self, timeout: float = 15.0) -> None:
        for agent in self._agents.values():
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        adopted = {node: _pidfd(pid) for node, pid in self._adopted.items()}
        for node, fd in adopted.items():
            if fd is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._adopted[node], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for agent in self._agents.values():
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(timeout=10)
        for node, fd in adopted.items():
            if fd is None:
                continue
            try:
                if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self._adopted[node], signal.SIGKILL)
            finally:
                os.close(fd)
        self._adopted.clear()


def _is_agent(pid: int, job_id: str, node_id: str) -> bool:
    """Whether ``pid`` is this machine's agent of ``node_id`` in ``job_id`` (the pid comes
    from the store: a recycled pid or a record of another machine must not be signalled)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    if "launcher.node.agent" not in argv:
        return False
    try:
        settings = json.loads(argv[argv.index("launcher.node.agent") + 1])
    except (IndexError, ValueError):
        return False
    return (
        isinstance(settings, dict)
        and settings.get("job_id") == job_id
        and settings.get("node_id") == node_id
    )


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (None if it is gone already)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
