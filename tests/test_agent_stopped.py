"""The agent's look at a process's state (/proc/<pid>/stat): how it tells a stopped process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from launcher.node.processes import process_state


def test_the_state_letter_follows_stop_and_continue() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert process_state(child.pid) in {"R", "S"}
        child.send_signal(signal.SIGSTOP)
        os.waitid(os.P_PID, child.pid, os.WSTOPPED)  # returns once the child has stopped
        assert process_state(child.pid) == "T"
        child.send_signal(signal.SIGCONT)
        os.waitid(os.P_PID, child.pid, os.WCONTINUED)
        assert process_state(child.pid) in {"R", "S"}
    finally:
        child.kill()
        child.wait(timeout=10)
    assert process_state(child.pid) is None
