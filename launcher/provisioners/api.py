"""The provisioner boundary: how the launcher gets worker nodes (agents) started and stopped.

A provisioner only starts and stops agents; the agents register themselves in the store, which
is where the launcher learns that a node is alive. ``start_nodes`` must not block on the agents
becoming ready. ``stop_node`` asks for a graceful leave (SIGTERM to the agent); ``close`` stops
every node it started. Errors derive from ElasticAllreduceError.
"""

from __future__ import annotations

import abc


class Provisioner(abc.ABC):
    """Starts and stops the agents of one job."""

    @abc.abstractmethod
    def start_nodes(self, count: int) -> list[str]:
        """Start ``count`` new nodes; return their node ids."""

    @abc.abstractmethod
    def stop_node(self, node_id: str) -> None:
        """Ask a node to leave gracefully (its agent gets SIGTERM)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every node this provisioner started (gracefully, then by force). Idempotent."""
