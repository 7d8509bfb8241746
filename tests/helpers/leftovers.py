"""What a pytest session started and left behind: processes and test-host namespaces.

Which processes are *ours* (this session's): those whose environment carries
:data:`SESSION_MARKER` with this session's token, set in ``os.environ`` when the session
starts so that every child inherits it, through ``setsid``, ``ip netns exec`` and being
reparented to init alike; and those that descend from the pytest process (a child started
with an environment of its own). A process of another session or of the developer carries
neither and is never counted nor touched. Namespaces are ours when their name says the pytest
process made them (``eatns-<pid>-...``, see :mod:`tests.helpers.testhosts`; ``eakube-<pid>-...``,
the test cluster's, see :mod:`tests.helpers.kube.cluster`).

At the end of the session (:func:`pytest_sessionfinish`, imported by ``tests/conftest.py``)
leftovers get a grace period to exit; those still there are reported, killed, and fail the
run. Temp files go into a folder of the session's own: ``TMPDIR`` of every process it starts
names it (what a killed process leaves there, TensorFlow's autograph files among them, would
otherwise pile up in /tmp), and it is removed at the end (the pytest process itself keeps the
machine's temp folder, so pytest's own ``tmp_path`` folders are not affected).

Under pytest-xdist (``make test`` runs two workers) every worker is a session of its own and
checks what it started; its findings travel to the controller in ``workeroutput``, and the
controller fails the run and prints them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from tests.helpers import testhosts
from tests.helpers.kube import cluster as kube_cluster

#: Environment variable naming the test session a process belongs to (inherited by children).
SESSION_MARKER: Final = "ELASTIC_ALLREDUCE_TEST_SESSION"
#: Environment variable a single test sets on what it starts, to end exactly those processes.
TEST_MARKER: Final = "ELASTIC_ALLREDUCE_TEST_TAG"
#: Seconds the session-end check lets exiting processes go before it calls them leftovers.
DEFAULT_GRACE: Final = 10.0
_PROC = Path("/proc")


def new_token() -> str:
    """A marker value no other session or test has: this pid and random bits."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"


# -- reading /proc -----------------------------------------------------------------------------


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return None


def all_pids() -> list[int]:
    """Every process id on the machine (threads excluded)."""
    return [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may hold spaces): state first."""
    raw = _read(_PROC / str(pid) / "stat")
    if raw is None:
        return None
    return raw.decode(errors="replace").rsplit(")", 1)[-1].split()


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 else None


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (dead, waiting to be reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and bool(fields) and fields[0] not in {"Z", "X"}


def environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` was started with (None if absent)."""
    raw = _read(_PROC / str(pid) / "environ")
    if raw is None:
        return None
    prefix = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def command_line(pid: int) -> str:
    raw = _read(_PROC / str(pid) / "cmdline")
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace") if raw else "?"


def kind_of(command: str) -> str:
    """What a command line is, in the words of the session-end report."""
    words = command.split()
    names = [Path(word).name for word in words]
    if names and names[0] == "etcd":
        return "etcd server"
    if "elastic_allreduce.bootstrap" in words:
        return "training process"
    if "launcher.node.agent" in words or names[1:3] == ["elastic-run", "agent"]:
        return "elastic-run agent"
    if "elastic-run" in names[:2] or "launcher.cli" in words:
        return "elastic-run"
    for tool in ("horovodrun", "mpirun", "orted"):
        if tool in names[:2]:
            return tool
    return "process"


def descendants(root: int) -> set[int]:
    """The processes whose chain of parents reaches ``root`` (``root`` excluded)."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        parent = parent_pid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


# -- finding and ending processes --------------------------------------------------------------


@dataclass(frozen=True)
class Leftover:
    """A running process that a session or test started."""

    pid: int
    kind: str
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.kind}): {self.command[:300]}"


def find_processes(marker: str, value: str, *, root: int | None = None) -> list[Leftover]:
    """Running processes started with ``marker=value`` in their environment, and (``root``
    given) every running descendant of ``root``; never ``root`` itself or this process."""
    below = descendants(root) if root is not None else set()
    skip = {os.getpid(), root}
    found: list[Leftover] = []
    for pid in sorted(all_pids()):
        if pid in skip or not (pid in below or environ_value(pid, marker) == value):
            continue
        if is_running(pid):
            command = command_line(pid)
            found.append(Leftover(pid, kind_of(command), command))
    return found


Finder = Callable[[], list[Leftover]]


def wait_for_exit(find: Finder, timeout: float) -> list[Leftover]:
    """Poll ``find`` until it finds nothing or ``timeout`` seconds pass; what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = find()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def kill_all(find: Finder, timeout: float = 10.0) -> list[Leftover]:
    """SIGKILL what ``find`` finds, again and again (for what forked meanwhile), until it finds
    nothing or ``timeout`` seconds pass; returns what still runs then."""
    deadline = time.monotonic() + timeout
    while True:
        left = find()
        if not left or time.monotonic() >= deadline:
            return left
        for process in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
        time.sleep(0.02)


def _group_members(pgid: int) -> list[Leftover]:
    found: list[Leftover] = []
    for pid in all_pids():
        try:
            in_group = os.getpgid(pid) == pgid
        except OSError:
            continue
        if in_group and is_running(pid):
            command = command_line(pid)
            found.append(Leftover(pid, kind_of(command), command))
    return found


def end_process_tree(
    leader: int, timeout: float = 10.0, *, with_descendants: bool = True
) -> list[Leftover]:
    """SIGKILL the process group led by ``leader`` and (``with_descendants``: only while
    ``leader`` is not reaped, so that its pid cannot have been reused) every descendant of
    ``leader``, children in sessions of their own too; wait until they are gone and return any
    still running then."""
    below = descendants(leader) if with_descendants else set()

    def find() -> list[Leftover]:
        if with_descendants:  # children forked meanwhile (those of the dead are reparented)
            below.update(descendants(leader))
        members = {p.pid: p for p in _group_members(leader)}
        for pid in below:
            if pid not in members and is_running(pid):
                members[pid] = Leftover(pid, kind_of(command_line(pid)), command_line(pid))
        return list(members.values())

    return kill_all(find, timeout)


# -- namespaces -----------------------------------------------------------------------------------


def session_namespaces(creator: int) -> list[str]:
    """Test-host and test-cluster namespaces that process ``creator`` made
    (``eatns-<creator>-...``, ``eakube-<creator>-...``)."""
    prefixes = tuple(f"{prefix}-{creator}-" for prefix in (testhosts.PREFIX, kube_cluster.PREFIX))
    try:
        names = testhosts.all_namespaces()
    except testhosts.TestHostsError:  # no `ip` here: no namespaces either
        return []
    return [name for name in names if name.startswith(prefixes)]


def remove_namespaces(names: Iterable[str]) -> list[str]:
    """Kill what runs in each namespace and delete it; the problems met (empty: all gone)."""
    problems: list[str] = []
    for name in names:
        try:
            testhosts.kill_namespace(name)
        except testhosts.TestHostsError as exc:
            problems.append(str(exc))
        shutil.rmtree(testhosts.NETNS_ETC / name, ignore_errors=True)
    return problems


# -- the session-end check (pytest hooks; tests/conftest.py imports them) ----------------------


@dataclass
class _Session:
    token: str
    root: int
    scratch: Path
    processes: list[Leftover]
    namespaces: list[str]
    problems: list[str]
    #: What the xdist workers found (the controller's session only), one line each.
    from_workers: list[str]

    def lines(self) -> list[str]:
        """The findings, as the summary prints them."""
        return [
            *(f"process still running, killed: {process}" for process in self.processes),
            *(f"network namespace still present, removed: {name}" for name in self.namespaces),
            *(f"cleanup failed: {problem}" for problem in self.problems),
        ]


_state_key = pytest.StashKey[_Session]()
#: The key of an xdist worker's findings in its ``workeroutput``.
_WORKER_KEY: Final = "elastic_allreduce_leftovers"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--leftover-grace",
        type=float,
        default=DEFAULT_GRACE,
        help="seconds the session-end check waits for the processes the tests started to exit "
        f"before it reports, kills them and fails the run (default {DEFAULT_GRACE})",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """Mark every process this session will start (they inherit the environment) and give them
    a temp folder of the session's own."""
    token = new_token()
    os.environ[SESSION_MARKER] = token
    # Pins this process's temp folder (tempfile caches it) before TMPDIR names the scratch.
    scratch = Path(tempfile.mkdtemp(prefix="eat-", dir=tempfile.gettempdir()))
    os.environ["TMPDIR"] = str(scratch)
    session.config.stash[_state_key] = _Session(token, os.getpid(), scratch, [], [], [], [])


def _worker_output(config: pytest.Config) -> dict[str, Any] | None:
    """What an xdist worker sends its controller at its end (None outside a worker)."""
    output: dict[str, Any] | None = getattr(config, "workeroutput", None)
    return output


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """(xdist's controller) Keep what a finished worker's session-end check found."""
    state = node.config.stash.get(_state_key, None)
    found = getattr(node, "workeroutput", {}).get(_WORKER_KEY, [])
    if state is not None and found:
        worker = getattr(getattr(node, "gateway", None), "id", "a worker")
        state.from_workers += [f"[{worker}] {line}" for line in found]


@pytest.hookimpl(trylast=True)  # after the runner tore down the session's fixtures
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run if a process or namespace the tests started is still there, after a grace
    period for those that are exiting; kill them either way."""
    state = session.config.stash.get(_state_key, None)
    if state is None:
        return
    grace = float(session.config.getoption("--leftover-grace"))

    def ours() -> list[Leftover]:
        return find_processes(SESSION_MARKER, state.token, root=state.root)

    state.processes = wait_for_exit(ours, grace)
    state.namespaces = session_namespaces(state.root)
    if state.processes:
        still = kill_all(ours)
        state.problems += [f"could not kill {process}" for process in still]
    state.problems += remove_namespaces(state.namespaces)
    shutil.rmtree(state.scratch, ignore_errors=True)
    output = _worker_output(session.config)
    if output is not None:
        output[_WORKER_KEY] = state.lines()
    if (state.lines() or state.from_workers) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Show what the session-end check found (it runs before the summary is written)."""
    state = terminalreporter.config.stash.get(_state_key, None)
    if state is None or not (state.lines() or state.from_workers):
        return
    terminalreporter.write_sep("=", "left behind by the tests (the run fails)", red=True)
    for line in [*state.from_workers, *state.lines()]:
        terminalreporter.write_line(line)
