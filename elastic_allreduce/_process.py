"""Small process helpers shared by the embedded etcd, the agent, the local provisioner, the
training processes' bootstrap and the bench."""

from __future__ import annotations

import ctypes
import faulthandler
import io
import signal
import subprocess
import sys
from typing import Any, Final

_PR_SET_PDEATHSIG: Final = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn``: on Linux, SIGKILL this child when the thread that started it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def print_stacks_on_sigusr1() -> None:
    """Make `kill -USR1 PID` print every thread's stack to stderr: where a process waits.

    Skipped where stderr is no file (``main`` called in-process with its output captured).
    """
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return


def merged_output(*, text: bool) -> dict[str, Any]:
    """``Popen`` keyword arguments for a child that reads nothing and writes its stdout and
    stderr, merged, to one pipe, in a session of its own (a terminal's Ctrl-C reaches only its
    parent, which decides when it stops). ``text``: the pipe yields lines of text, undecodable
    bytes replaced."""
    options: dict[str, Any] = {
        "stdin": subprocess.DEVNULL,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.STDOUT,
        "start_new_session": True,
    }
    if text:
        options.update(text=True, errors="replace", bufsize=1)
    return options
