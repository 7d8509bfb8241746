"""The leftover check (tests/helpers/leftovers.py): it finds the processes a session started, by
environment marker and by ancestry, never another's; it kills them; and a pytest session that
leaves one behind fails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import leftovers

#: A harmless sleeper whose command line reads like a training process's (the words after the
#: ``-c`` code are only its ``sys.argv``).
SLEEPER = [
    sys.executable,
    "-c",
    "import time; time.sleep(120)",
    "-m",
    "elastic_allreduce.bootstrap",
]
#: Starts SLEEPER in a session of its own (holding none of this process's pipes), prints its pid
#: and exits: the sleeper is an orphan, no longer a descendant of whoever started this.
ORPHAN_MAKER = (
    "import subprocess, sys; "
    f"p = subprocess.Popen({SLEEPER!r}, start_new_session=True, stdin=subprocess.DEVNULL, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
    "print(p.pid)"
)


def environ_without_markers(**extra: str) -> dict[str, str]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in {leftovers.SESSION_MARKER, leftovers.TEST_MARKER}
    }
    return {**environ, **extra}


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pids_to_kill() -> Iterator[list[int]]:
    """Pids a test started (orphans too, which nobody reaps for it): SIGKILLed at its end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        kill(pid)


def start_orphan(environ: dict[str, str], pids: list[int]) -> int:
    made = subprocess.run(
        [sys.executable, "-c", ORPHAN_MAKER],
        env=environ,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid = int(made.stdout)
    pids.append(pid)
    return pid


def test_a_process_with_the_marker_is_found_and_one_without_is_not() -> None:
    token = leftovers.new_token()
    marked = subprocess.Popen(
        SLEEPER, env=environ_without_markers(**{leftovers.TEST_MARKER: token})
    )
    unmarked = subprocess.Popen(SLEEPER, env=environ_without_markers())
    try:
        found = leftovers.find_processes(leftovers.TEST_MARKER, token)
        assert [p.pid for p in found] == [marked.pid]
        assert found[0].kind == "training process"
        assert "elastic_allreduce.bootstrap" in found[0].command
        # By ancestry, both children of this process are found (the marker is not needed).
        below = leftovers.find_processes(leftovers.TEST_MARKER, token, root=os.getpid())
        assert {marked.pid, unmarked.pid} <= {p.pid for p in below}
    finally:
        for child in (marked, unmarked):
            child.kill()
            child.wait(timeout=10)


def test_an_orphan_is_found_by_its_marker_and_never_without_it(pids_to_kill: list[int]) -> None:
    token = leftovers.new_token()
    marked = start_orphan(environ_without_markers(**{leftovers.TEST_MARKER: token}), pids_to_kill)
    unmarked = start_orphan(environ_without_markers(), pids_to_kill)
    below = leftovers.descendants(os.getpid())
    assert marked not in below and unmarked not in below  # both left this process's tree
    assert leftovers.is_running(marked) and leftovers.is_running(unmarked)
    found = leftovers.find_processes(leftovers.TEST_MARKER, token, root=os.getpid())
    assert marked in {p.pid for p in found}
    assert unmarked not in {p.pid for p in found}


def test_kill_all_ends_only_what_it_finds(pids_to_kill: list[int]) -> None:
    token = leftovers.new_token()
    marked = start_orphan(environ_without_markers(**{leftovers.TEST_MARKER: token}), pids_to_kill)
    unmarked = start_orphan(environ_without_markers(), pids_to_kill)

    def tagged() -> list[leftovers.Leftover]:
        return leftovers.find_processes(leftovers.TEST_MARKER, token)

    assert [p.pid for p in tagged()] == [marked]
    assert leftovers.kill_all(tagged, timeout=10) == []
    assert not leftovers.is_running(marked)
    assert leftovers.is_running(unmarked)


def test_end_process_tree_ends_the_group_and_children_in_sessions_of_their_own() -> None:
    spawner = textwrap.dedent(
        f"""
        import subprocess, sys, time
        same_group = subprocess.Popen({SLEEPER!r})
        own_session = subprocess.Popen({SLEEPER!r}, start_new_session=True)
        print(same_group.pid, own_session.pid, flush=True)
        time.sleep(120)
        """
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", spawner],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    children = [int(word) for word in leader.stdout.readline().split()]
    try:
        assert len(children) == 2
        assert os.getpgid(children[0]) == leader.pid
        assert os.getpgid(children[1]) != leader.pid
        assert leftovers.end_process_tree(leader.pid, timeout=10) == []
        assert leader.wait(timeout=10) == -signal.SIGKILL
        assert not any(leftovers.is_running(pid) for pid in children)
    finally:
        for pid in [leader.pid, *children]:
            kill(pid)
        leader.wait(timeout=10)
        leader.stdout.close()


def test_kind_of_names_the_processes_the_tests_start() -> None:
    python = sys.executable
    assert leftovers.kind_of("/usr/bin/etcd --name x --data-dir /tmp/d") == "etcd server"
    assert leftovers.kind_of(f"{python} /v/bin/elastic-run --standalone -- python t.py") == (
        "elastic-run"
    )
    assert leftovers.kind_of(f"{python} -m launcher.node.agent {{}}") == "elastic-run agent"
    assert leftovers.kind_of(f"{python} -m elastic_allreduce.bootstrap t.py") == (
        "training process"
    )
    assert leftovers.kind_of(f"{python} /v/bin/horovodrun -np 2 python t.py") == "horovodrun"
    assert leftovers.kind_of("mpirun -np 2 python t.py") == "mpirun"
    assert leftovers.kind_of("sleep 60") == "process"


# -- the check at the end of a real pytest session ---------------------------------------------

LEAKING_TEST = f"""
import subprocess, sys
from pathlib import Path

def test_leaves_a_process_behind():
    proc = subprocess.Popen({SLEEPER!r}, start_new_session=True)
    Path("leaked.pid").write_text(str(proc.pid))
"""

CLEAN_TEST = f"""
import os, subprocess, sys
from pathlib import Path

def test_cleans_up_but_sees_another_process():
    environ = {{k: v for k, v in os.environ.items() if k != "{leftovers.SESSION_MARKER}"}}
    made = subprocess.run([sys.executable, "-c", {ORPHAN_MAKER!r}], env=environ,
                          capture_output=True, text=True, check=True)
    Path("foreign.pid").write_text(made.stdout.strip())
    proc = subprocess.Popen({SLEEPER!r})
    proc.kill()
    proc.wait()
"""


TEMP_TEST = """
import os, subprocess, sys, tempfile
from pathlib import Path

def test_starts_a_process_that_leaves_a_temp_file():
    script = "import tempfile; print(tempfile.mkstemp(suffix='.left')[1])"
    made = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    Path("children.tmp").write_text(os.environ["TMPDIR"] + "\\n" + made.stdout.strip())
    Path("own.tmp").write_text(tempfile.gettempdir())
"""


def run_session(folder: Path, test: str, *options: str) -> subprocess.CompletedProcess[str]:
    """Run ``test`` in a pytest session of its own with the leftover check as its plugin
    (``options``: more of pytest's, such as xdist's ``-n``)."""
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_it.py").write_text(test)
    return subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "tests.helpers.leftovers", "-p"),
            *("no:cacheprovider", "-c", str(folder / "pytest.ini"), "--rootdir", str(folder)),
            *("--leftover-grace", "1", *options, str(folder / "test_it.py")),
        ],
        cwd=folder,  # where the test writes its pid files
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_a_session_that_leaves_a_process_behind_fails_and_the_process_is_killed(
    tmp_path: Path, pids_to_kill: list[int]
) -> None:
    done = run_session(tmp_path, LEAKING_TEST)
    leaked = int((tmp_path / "leaked.pid").read_text())
    pids_to_kill.append(leaked)
    output = done.stdout + done.stderr
    assert "1 passed" in output, output
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "left behind by the tests" in output, output
    assert f"pid {leaked} (training process)" in output, output
    assert not leftovers.is_running(leaked)


def test_a_clean_session_passes_and_leaves_other_processes_alone(
    tmp_path: Path, pids_to_kill: list[int]
) -> None:
    done = run_session(tmp_path, CLEAN_TEST)
    foreign = int((tmp_path / "foreign.pid").read_text())
    pids_to_kill.append(foreign)
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.OK, output
    assert "left behind by the tests" not in output, output
    assert leftovers.is_running(foreign)  # not this session's: neither counted nor killed


def test_under_xdist_a_workers_leftover_fails_the_run_and_the_controller_names_it(
    tmp_path: Path, pids_to_kill: list[int]
) -> None:
    done = run_session(tmp_path, LEAKING_TEST, "-n", "1")
    leaked = int((tmp_path / "leaked.pid").read_text())
    pids_to_kill.append(leaked)
    output = done.stdout + done.stderr
    assert "1 passed" in output, output
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert f"[gw0] process still running, killed: pid {leaked} (training process)" in output
    assert not leftovers.is_running(leaked)


def test_what_the_tests_processes_leave_in_the_temp_folder_goes_with_the_session(
    tmp_path: Path,
) -> None:
    done = run_session(tmp_path, TEMP_TEST)
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    scratch, left = (tmp_path / "children.tmp").read_text().splitlines()
    assert Path(left).parent == Path(scratch)  # the child's temp file was in the scratch
    assert not Path(scratch).exists()  # and the session removed it, with the file
    # The pytest process itself kept the temp folder it was started with (this session's
    # scratch, which run_session passed on), so its own tmp_path folders are not removed.
    assert (tmp_path / "own.tmp").read_text() == os.environ["TMPDIR"] != scratch
