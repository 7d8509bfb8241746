"""The sample audit checker: applied steps are the highest ring epoch's executions."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_allreduce.training.audit import SampleLog, check, main


def write(directory: Path, name: str, lines: list[dict[str, object]]) -> None:
    with open(directory / f"{name}.jsonl", "a") as handle:
        for line in lines:
            handle.write(json.dumps(line) + "\n")


def test_a_rolled_back_step_is_replaced_by_its_rerun(tmp_path: Path) -> None:
    write(
        tmp_path,
        "a",
        [
            {"ring": 1, "epoch": 0, "step": 0, "rank": 0, "ids": [0, 1]},
            {"ring": 1, "epoch": 0, "step": 1, "rank": 0, "ids": [4, 5]},  # rolled back
            {"ring": 2, "epoch": 0, "step": 1, "rank": 0, "ids": [4]},
        ],
    )
    write(
        tmp_path,
        "b",
        [
            {"ring": 1, "epoch": 0, "step": 0, "rank": 1, "ids": [2, 3]},
            {"ring": 1, "epoch": 0, "step": 1, "rank": 1, "ids": [6, 7]},  # rolled back
            {"ring": 2, "epoch": 0, "step": 1, "rank": 1, "ids": [5]},
        ],
    )
    (report,) = check(tmp_path, 6)
    assert report.ok and report.steps == 2 and report.samples == 6
    assert main([str(tmp_path), "--samples", "6", "--epochs", "1"]) == 0


def test_missing_and_duplicated_ids_are_reported(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    log = SampleLog(str(tmp_path), name="r0")
    assert log.enabled
    log.record(1, 0, 0, 0, [0, 1, 1])
    log.record(1, 0, 1, 0, [3])
    (report,) = check(tmp_path, 4)
    assert report.missing == (2,) and report.duplicated == (1,)
    assert main([str(tmp_path), "--samples", "4"]) == 1
    assert "1 missing, 1 duplicated: FAILED" in capsys.readouterr().out


def test_an_empty_log_or_a_missing_epoch_fails(tmp_path: Path) -> None:
    assert main([str(tmp_path), "--samples", "4"]) == 1
    write(tmp_path, "a", [{"ring": 1, "epoch": 0, "step": 0, "rank": 0, "ids": [0, 1, 2, 3]}])
    assert main([str(tmp_path), "--samples", "4"]) == 0
    assert main([str(tmp_path), "--samples", "4", "--epochs", "2"]) == 1


def test_the_log_is_off_without_a_directory(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("ELASTIC_ALLREDUCE_SAMPLE_LOG", raising=False)
    log = SampleLog()
    assert not log.enabled
    log.record(1, 0, 0, 0, [1])  # a no-op
