"""An owner's inbox takes a signal handler's put while the owner waits in it.

A handler runs in the main thread between two bytecodes, also inside ``get``, where a
queue.Queue holds its lock: a SIGTERM arriving there hung the agent for good (seen once in CI:
a stopped node never left). The script below makes that moment likely: a timer signal every
0.3 ms puts into the inbox while the main thread drains it and a thread feeds it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

SCRIPT = textwrap.dedent(
    """
    import signal, threading, time
    from elastic_allreduce.store.cache import drain, new_inbox

    inbox = new_inbox()
    signalled = 0

    def on_signal(signum, frame):
        global signalled
        signalled += 1
        inbox.put(("signal", signalled))

    def feed():
        while True:
            inbox.put("event")
            time.sleep(0.0001)

    signal.signal(signal.SIGALRM, on_signal)
    threading.Thread(target=feed, daemon=True).start()
    signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
    taken = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        taken += sum(1 for item in drain(inbox, timeout=0.01) if item != "event")
    signal.setitimer(signal.ITIMER_REAL, 0)
    taken += sum(1 for item in drain(inbox, timeout=0.01) if item != "event")
    print("signals", signalled, "taken", taken, flush=True)
    """
)


def test_a_signal_handler_can_put_while_the_owner_drains() -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the owner hung in its inbox: {exc.stderr!r}") from exc
    assert done.returncode == 0, done.stderr[-2000:]
    words = done.stdout.split()
    assert words[0] == "signals" and words[2] == "taken", done.stdout
    signalled, taken = int(words[1]), int(words[3])
    assert signalled > 1000, done.stdout  # the handler ran often enough to hit the window
    assert taken == signalled, done.stdout  # every note the handlers put was delivered
