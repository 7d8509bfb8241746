"""What every item gets: the run's mode, a private etcd, and figures earlier items measured."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from elastic_allreduce.store import EmbeddedEtcd

_numbers = itertools.count(1)


@dataclass
class Context:
    """Shared by the items of one suite run."""

    quick: bool
    etcd: EmbeddedEtcd
    #: Results of the items that ran before, by item name (later items may use them).
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoints(self) -> str:
        return self.etcd.endpoints_text

    def job_id(self, stem: str) -> str:
        return f"bench-{stem}-{os.getpid()}-{next(_numbers)}"

    def pick(self, quick: Any, full: Any) -> Any:
        """``quick`` in a quick run, else ``full``."""
        return quick if self.quick else full
