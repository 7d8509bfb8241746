"""Worker nodes as local agent processes (``elastic-run`` without a cluster)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import subprocess
import sys

from elastic_allreduce._process import die_with_parent
from launcher.agent import NodeTemplate
from launcher.provisioners.api import Provisioner


class LocalProvisioner(Provisioner):
    """Runs each node as ``python -m launcher.agent`` on this machine (output inherited)."""

    def __init__(self, template: NodeTemplate) -> None:
        self._template = template
        self._numbers = itertools.count()
        self._agents: dict[str, subprocess.Popen[bytes]] = {}

    def start_nodes(self, count: int) -> list[str]:
        started = []
        for _ in range(count):
            node_id = f"n{next(self._numbers)}"
            settings = dataclasses.replace(self._template.for_node(node_id), provisioned=True)
            payload = json.dumps(dataclasses.asdict(settings))
            # Own session: the launcher, not the terminal's Ctrl-C, decides when agents stop;
            # and an agent dies with the launcher even when the launcher is SIGKILLed.
            self._agents[node_id] = subprocess.Popen(
                [sys.executable, "-m", "launcher.agent", payload],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl
            )
            started.append(node_id)
        return started

    def stop_node(self, node_id: str) -> None:
        agent = self._agents.get(node_id)
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)

    def close(self, timeout: float = 15.0) -> None:
        for agent in self._agents.values():
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self._agents.values():
            try:
                agent.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(timeout=10)
