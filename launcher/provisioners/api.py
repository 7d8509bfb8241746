"""The provisioner boundary: how the launcher gets worker nodes (agents) started and stopped.

A provisioner only starts and stops agents; the agents register themselves in the store, which
is where the launcher learns that a node is alive. ``start_nodes`` must not block on the agents
becoming ready. ``stop_node`` asks for a graceful leave (SIGTERM to the agent); ``close`` stops
every node it started. Errors derive from ElasticAllreduceError (a cluster's API errors from
ProvisionerError).

A provisioner that sees more than the store (a cluster's scheduler) reports it through
:meth:`Provisioner.node_states`: nodes still waiting to be placed, and nodes lost without being
asked to stop. It calls the callback given to :meth:`Provisioner.subscribe` (from any thread)
whenever that changes, so the launcher's loop looks again.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from elastic_allreduce.records.values import MemberRecord


@dataclass(frozen=True)
class NodeStates:
    """What a provisioner knows about its nodes beyond the store."""

    #: Nodes the cluster cannot place yet (for example unschedulable pods).
    pending: frozenset[str] = frozenset()
    #: Nodes lost without a stop_node(), and why; cumulative over the provisioner's life.
    disrupted: Mapping[str, str] = field(default_factory=dict)
    #: Nodes whose processes are known to be gone (a failed, finished or deleted pod), before
    #: their leases in the store expire.
    dead: frozenset[str] = frozenset()


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

    def release(self) -> None:
        """Stop managing the nodes but leave them running: the launcher hands the job over to
        the next one, which adopts them. Default: :meth:`close` (a provisioner whose nodes
        cannot outlive it)."""
        self.close()

    def adopt(self, members: Mapping[str, MemberRecord]) -> frozenset[str]:
        """The launcher took over a running job whose nodes are ``members``: manage the ones
        this provisioner can reach as if it had started them; their ids (the policy then
        replaces them when they are lost). Default: none (a provisioner whose nodes cannot
        outlive it: the job's nodes joined by themselves)."""
        return frozenset()

    def node_states(self) -> NodeStates:
        """Pending and disrupted nodes (none for a provisioner that cannot tell)."""
        return NodeStates()

    def subscribe(self, changed: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Call ``changed()`` whenever :meth:`node_states` may have changed."""
