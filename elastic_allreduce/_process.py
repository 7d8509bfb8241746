"""Small process helpers shared by the embedded etcd, the agent and the local provisioner."""

from __future__ import annotations

import ctypes
import signal
import sys
from typing import Final

_PR_SET_PDEATHSIG: Final = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn``: on Linux, SIGKILL this child when the thread that started it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
