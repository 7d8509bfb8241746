"""The error a script ended with, from the bootstrap through the agent to the launcher (issue
#39, item 3): what is written, what is never taken for a bug in the script, and the agent's
reading of a file the process wrote (untrusted). The launcher's rules: tests/test_policy.py; a
real job: tests/integration/test_script_bugs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tensorflow as tf
from horovod.common.exceptions import HorovodInternalError

from elastic_allreduce import env
from elastic_allreduce.bootstrap import process
from elastic_allreduce.bootstrap.process import script_error, write_script_error
from elastic_allreduce.records.values import (
    MAX_ERROR_LINES,
    NOT_ADMITTED_EXIT_CODE,
    STATE_MISMATCH_EXIT_CODE,
    ScriptError,
)
from launcher.node.processes import MAX_ERROR_FILE, read_script_error


class DataError(Exception):
    """An exception class of the script's own (``__main__`` when it is the script)."""


def raised(exc: BaseException) -> BaseException:
    """``exc`` with a traceback, as the bootstrap catches it."""
    try:
        raise exc
    except BaseException as caught:  # any kind, as the bootstrap sees it
        return caught


def test_an_exception_is_its_type_message_and_last_traceback_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "progress_ticks", lambda: 0)
    error = script_error(raised(ValueError("bad batch at step 3")))
    assert error is not None
    assert (error.kind, error.message) == ("ValueError", "bad batch at step 3")
    assert error.lines[-1] == "ValueError: bad batch at step 3"
    assert any("in raised" in line for line in error.lines)
    assert not any(set(line.strip()) <= {"^", "~"} for line in error.lines)
    assert (error.epoch, error.trained) == (0, False)  # outside a ring, no step counted
    monkeypatch.setattr(process, "progress_ticks", lambda: 3)
    trained = script_error(raised(ValueError("bad batch at step 3")))
    assert trained is not None and trained.trained


def test_a_scripts_own_exception_class_is_named_with_its_module() -> None:
    error = script_error(raised(DataError("shard 7 is empty")))
    assert error is not None and error.kind == "tests.test_script_errors.DataError"


def test_a_long_message_and_traceback_are_cut_to_the_records_limits() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise RuntimeError("x" * 5000)
        deep(n - 1)

    try:
        deep(30)
    except RuntimeError as exc:
        error = script_error(exc)
    assert error is not None and len(error.message) == 2000
    assert len(error.lines) == MAX_ERROR_LINES
    assert ScriptError.from_json("k", error.to_json()) == error


@pytest.mark.parametrize(
    ("code", "message"),
    [(2, "exit code 2"), ("usage: train.py --data DIR", "usage: train.py --data DIR")],
)
def test_sys_exit_with_a_code_is_an_error(code: int | str, message: str) -> None:
    error = script_error(raised(SystemExit(code)))
    assert error is not None and (error.kind, error.message) == ("SystemExit", message)


@pytest.mark.parametrize(
    "exc",
    [
        SystemExit(0),
        SystemExit(None),
        SystemExit(NOT_ADMITTED_EXIT_CODE),  # a slot the ring let go
        SystemExit(STATE_MISMATCH_EXIT_CODE),  # judged on its own
        HorovodInternalError("a peer died"),
        tf.errors.UnknownError(None, None, "[gloo/transport/tcp/pair.cc:598] Connection closed"),
    ],
    ids=["exit-0", "exit-none", "not-admitted", "state-mismatch", "horovod", "gloo"],
)
def test_what_is_no_bug_of_the_script_is_never_written(exc: BaseException) -> None:
    assert script_error(raised(exc)) is None


def test_the_bootstrap_writes_the_error_where_the_agent_reads_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "n0.0.2.json"
    monkeypatch.setenv(env.ERROR_FILE, str(path))
    write_script_error(raised(KeyError("label")))
    read = read_script_error(str(path))
    assert read is not None and (read.kind, read.message) == ("KeyError", "'label'")
    assert not path.exists() and read_script_error(str(path)) is None  # taken, removed


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"\xff\xfe",
        json.dumps({"kind": "E", "message": 3, "epoch": 0}).encode(),
        json.dumps(["a list"]).encode(),
        b" " * (MAX_ERROR_FILE + 1),
    ],
    ids=["text", "bytes", "wrong-field", "not-an-object", "too-long"],
)
def test_a_file_that_is_no_valid_record_is_ignored_and_removed(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "error.json"
    path.write_bytes(content)
    assert read_script_error(str(path)) is None
    assert not path.exists()
