"""TensorBoard summaries: rank 0's writer, the launcher's writer and the flag, read back from
the event files with ``tf.compat.v1.train.summary_iterator``."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from elastic_allreduce import env, progress
from elastic_allreduce.errors import ConfigError
from elastic_allreduce.records.values import EpochCause, JobConfig, JobSettings
from elastic_allreduce.training import tensorboard as worker_tb
from launcher.observe import tensorboard as launcher_tb
from launcher.vocabulary import ChangeKind, MembershipChange
from tests.conftest import ROOT
from tests.helpers.tensorboard_files import event_files, read_dir, series

TAGS = ("loss", "learning_rate", "samples_per_second", "ring/size")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def summaries(
    directory: Path, clock: Clock, rate: float | None = 0.05
) -> worker_tb.RankZeroSummaries:
    return worker_tb.RankZeroSummaries(
        directory, learning_rate=(lambda: rate), flush_seconds=5.0, clock=clock
    )


def steps(writer: worker_tb.RankZeroSummaries, first: int, last: int, samples: int = 12) -> None:
    for step in range(first, last + 1):
        writer.on_step(step, 0.1, samples, {"loss": 1.0 / step})


# -- rank 0's summaries -------------------------------------------------------------------------


def test_rank_zero_writes_every_steps_scalars_at_its_flush(tmp_path: Path, clock: Clock) -> None:
    writer = summaries(tmp_path, clock)
    writer.ring(rank=0, size=3, epoch=1, step=0, cause=None)
    steps(writer, 1, 4)
    # Buffered: only the start marker is on disk until a flush is due.
    on_disk = read_dir(tmp_path)
    assert {p.tag for p in on_disk} == {"ring/changes", "ring/epoch", "ring/size"}
    assert series(on_disk, "ring/changes") == [(0, "ring epoch 1: 3 ranks (start), from step 0")]
    clock.now += 5.0
    steps(writer, 5, 5)  # the step that finds the flush due writes all five
    points = read_dir(tmp_path)
    assert series(points, "loss") == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert series(points, "learning_rate") == [(s, pytest.approx(0.05)) for s in range(1, 6)]
    # samples/s: the global batch over the step's seconds.
    assert series(points, "samples_per_second") == [(s, pytest.approx(120.0)) for s in range(1, 6)]
    assert series(points, "ring/size") == [(0, 3.0)] + [(s, 3.0) for s in range(1, 6)]
    assert len(event_files(tmp_path)) == 1
    writer.close()


def test_a_membership_change_is_a_marker_at_the_step_the_ring_trains_from(
    tmp_path: Path, clock: Clock
) -> None:
    writer = summaries(tmp_path, clock)
    writer.ring(rank=0, size=3, epoch=1, step=0, cause=None)
    steps(writer, 1, 7)
    writer.ring(rank=0, size=2, epoch=2, step=5, cause="failure, 2 steps rolled back")
    # The marker flushed what was buffered before it, and itself.
    points = read_dir(tmp_path)
    assert [s for s, _ in series(points, "loss")] == list(range(1, 8))
    assert series(points, "ring/changes") == [
        (0, "ring epoch 1: 3 ranks (start), from step 0"),
        (5, "ring epoch 2: 3 -> 2 ranks (failure, 2 steps rolled back), from step 5"),
    ]
    assert series(points, "ring/epoch") == [(0, 1.0), (5, 2.0)]
    steps(writer, 6, 8, samples=8)
    writer.ring(rank=0, size=3, epoch=3, step=8, cause="resize")
    writer.close()
    points = read_dir(tmp_path)
    # The size steps down at the marker, and up again at the next one.
    assert series(points, "ring/size")[-5:] == [(5, 2.0), (6, 2.0), (7, 2.0), (8, 2.0), (8, 3.0)]
    grown = "ring epoch 3: 2 -> 3 ranks (resize), from step 8"
    assert series(points, "ring/changes")[-1] == (8, grown)
    # The steps rolled back (6, 7) were run again: both runs are in the file.
    assert [s for s, _ in series(points, "loss")] == [1, 2, 3, 4, 5, 6, 7, 6, 7, 8]


def test_other_ranks_write_nothing_and_the_next_rank_zero_takes_over(
    tmp_path: Path, clock: Clock
) -> None:
    first = summaries(tmp_path, clock)
    second = summaries(tmp_path, clock)
    first.ring(rank=0, size=3, epoch=1, step=0, cause=None)
    second.ring(rank=1, size=3, epoch=1, step=0, cause=None)
    assert first.writing and not second.writing
    clock.now += 10.0
    steps(first, 1, 3)
    steps(second, 1, 3)
    second.on_commit(3)
    assert len(event_files(tmp_path)) == 1  # rank 1 created no file
    # Rank 0 dies without a word; its successor writes the marker and goes on in its own file.
    second.ring(rank=0, size=2, epoch=2, step=3, cause="failure, 0 steps rolled back")
    steps(second, 4, 5, samples=8)
    second.close()
    files = event_files(tmp_path)
    assert len(files) == 2
    points = read_dir(tmp_path)
    by_file = {p.file for p in points if p.tag == "ring/changes" and p.step == 3}
    assert len(by_file) == 1 and by_file != {files[0].name}  # written by the second process
    assert series(points, "ring/size")[-3:] == [(3, 2.0), (4, 2.0), (5, 2.0)]
    # The dead rank 0 had flushed at step 1 (due); steps 2 and 3 died in its buffer.
    assert [s for s, _ in series(points, "loss")] == [1, 4, 5]


def test_metrics_name_the_learning_rate_and_commits_add_nothing_to_reported_steps(
    tmp_path: Path, clock: Clock
) -> None:
    read: list[int] = []

    def rate() -> float:
        read.append(1)
        return 0.5

    writer = worker_tb.RankZeroSummaries(tmp_path, learning_rate=rate, clock=clock)
    writer.ring(rank=0, size=2, epoch=1, step=0, cause=None)
    metrics: Mapping[str, float] = {"lr": 0.25, "accuracy": 0.75}
    writer.on_step(1, None, None, metrics)  # "lr", as Keras' LearningRateScheduler logs it
    writer.on_step(2, 0.2, None, {"loss": 2.0, "names": "not a number"})  # type: ignore[dict-item]
    writer.on_commit(2)  # the steps have their points: a commit adds none
    writer.on_commit(10)
    writer.close()
    points = read_dir(tmp_path)
    assert series(points, "learning_rate") == [(1, 0.25), (2, 0.5)]
    assert read == [1]  # the optimizer is read only when the metrics do not say
    assert series(points, "accuracy") == [(1, 0.75)]
    assert series(points, "samples_per_second") == []  # no samples given
    assert "names" not in {p.tag for p in points}
    assert series(points, "ring/size") == [(0, 2.0), (1, 2.0), (2, 2.0)]


def test_a_script_that_reports_no_steps_gets_the_ring_size_at_its_commits(
    tmp_path: Path, clock: Clock
) -> None:
    writer = summaries(tmp_path, clock)
    writer.ring(rank=0, size=3, epoch=1, step=0, cause=None)
    writer.on_commit(5)
    writer.on_commit(10)
    writer.ring(rank=0, size=2, epoch=2, step=10, cause="failure, 0 steps rolled back")
    writer.on_commit(15)
    writer.close()
    points = read_dir(tmp_path)
    assert series(points, "ring/size") == [(0, 3.0), (5, 3.0), (10, 3.0), (10, 2.0), (15, 2.0)]
    assert series(points, "loss") == series(points, "samples_per_second") == []


def test_a_directory_that_cannot_be_written_stops_the_summaries_not_the_training(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    writer = summaries(blocked / "train", clock)
    with caplog.at_level(logging.WARNING):
        writer.ring(rank=0, size=2, epoch=1, step=0, cause=None)
        steps(writer, 1, 3)
        clock.now += 10
        steps(writer, 4, 4)
        writer.close()
    assert not writer.writing
    assert [r for r in caplog.records if "TensorBoard summaries stopped" in r.message]


# -- the step listener and the environment -----------------------------------------------------


@pytest.fixture
def detached() -> Iterator[None]:
    """Undo attach(): no process-wide summaries before or after the test."""
    worker_tb._attached.clear()
    yield
    for attached in worker_tb._attached:
        progress.remove_step_listener(attached.on_step)
        attached.close()
    worker_tb._attached.clear()


def test_report_step_hands_each_step_to_the_listeners() -> None:
    seen: list[tuple[int, float | None, int | None, Mapping[str, float] | None]] = []

    def listener(
        step: int, seconds: float | None, samples: int | None, metrics: Mapping[str, float] | None
    ) -> None:
        seen.append((step, seconds, samples, metrics))

    progress.add_step_listener(listener)
    try:
        progress.report_step(41)
        progress.report_step(42, samples=64, metrics={"loss": 0.5})
    finally:
        progress.remove_step_listener(listener)
    progress.report_step(43)
    assert [(s[0], s[2], s[3]) for s in seen] == [(41, None, None), (42, 64, {"loss": 0.5})]
    assert seen[1][1] is not None and seen[1][1] >= 0
    assert progress.current_step() == 43


def test_attach_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, detached: None
) -> None:
    monkeypatch.delenv(env.TENSORBOARD_DIR, raising=False)
    assert worker_tb.attach() is None
    monkeypatch.setenv(env.TENSORBOARD_DIR, str(tmp_path))
    attached = worker_tb.attach(lambda: 0.125)
    assert attached is not None and attached is worker_tb.attach()
    assert attached.directory == tmp_path / "train"
    attached.ring(rank=0, size=1, epoch=1, step=0, cause=None)
    progress.report_step(7, samples=4, metrics={"loss": 3.0})
    attached.close()
    points = read_dir(tmp_path / "train")
    assert series(points, "loss") == [(7, 3.0)]
    assert series(points, "learning_rate") == [(7, 0.125)]


def test_the_learning_rate_is_read_from_a_keras_optimizer() -> None:
    import tensorflow as tf  # noqa: PLC0415

    plain = tf.keras.optimizers.SGD(0.25)
    assert worker_tb.learning_rate_of(plain)() == pytest.approx(0.25)
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.5)
    decaying = tf.keras.optimizers.SGD(schedule)
    assert worker_tb.learning_rate_of(decaying)() == pytest.approx(0.5)
    assert worker_tb.learning_rate_of(object())() is None


# -- the launcher's summaries -------------------------------------------------------------------


def reformed(epoch: int, cause: EpochCause, duration: float | None, slots: int) -> MembershipChange:
    names = tuple(f"n{i}.0" for i in range(slots))
    return MembershipChange(ChangeKind.REFORMED, epoch, names, "re-formed", cause, duration)


def test_the_launcher_writes_each_recoverys_duration_by_cause(tmp_path: Path) -> None:
    directory = str(tmp_path)
    launcher_tb.record_change(directory, reformed(1, EpochCause.START, 0.9, 3))
    launcher_tb.record_change(
        directory, MembershipChange(ChangeKind.CRASHED, 1, ("n1.0",), "killed")
    )
    launcher_tb.record_change(directory, reformed(2, EpochCause.FAILURE, 0.375, 2))
    launcher_tb.record_change(directory, reformed(3, EpochCause.RESIZE, 1.5, 3))
    launcher_tb.record_change(directory, reformed(4, EpochCause.FAILURE, None, 2))
    (path,) = event_files(tmp_path / "launcher")  # one file, appended to
    points = read_dir(tmp_path / "launcher")
    assert series(points, "recovery/failure") == [(2, 0.375)]
    assert series(points, "recovery/resize") == [(3, 1.5)]
    assert series(points, "ring/size") == [(2, 2.0), (3, 3.0)]
    assert series(points, "ring/reformed") == [
        (2, "epoch 2 (failure): 2 ranks n0.0, n1.0 in 0.38 s"),
        (3, "epoch 3 (resize): 3 ranks n0.0, n1.0, n2.0 in 1.50 s"),
    ]
    assert path.name.endswith(".launcher")


def test_the_launchers_writer_needs_no_tensorflow(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from launcher.observe.tensorboard import LauncherSummaries\n"
        f"LauncherSummaries({str(tmp_path)!r}).write(1, scalars={{'recovery/failure': 0.5}}, "
        "text={})\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow')\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert series(read_dir(tmp_path), "recovery/failure") == [(1, 0.5)]


def test_a_launcher_that_cannot_write_logs_once_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    writer = launcher_tb.LauncherSummaries(blocked / "launcher")
    with caplog.at_level(logging.WARNING):
        writer.change(reformed(2, EpochCause.FAILURE, 0.5, 2))
        writer.change(reformed(3, EpochCause.FAILURE, 0.5, 2))
    assert len([r for r in caplog.records if "TensorBoard summaries stopped" in r.message]) == 1


# -- the flag and the stored job ----------------------------------------------------------------


def test_the_flag_is_checked_made_absolute_and_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert launcher_tb.resolve_directory(None) is None
    with pytest.raises(ConfigError, match="--tensorboard-dir is empty"):
        launcher_tb.resolve_directory(" ")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--tensorboard-dir .*/file exists and is not a dir"):
        launcher_tb.resolve_directory(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="cannot be created"):
        launcher_tb.resolve_directory(str(tmp_path / "file" / "below"))
    monkeypatch.chdir(tmp_path)
    assert launcher_tb.resolve_directory("tb/run1") == str(tmp_path / "tb" / "run1")
    assert (tmp_path / "tb" / "run1").is_dir()


@pytest.mark.parametrize("command", ["run", "train"])
def test_run_and_train_refuse_a_bad_directory_with_one_line(tmp_path: Path, command: str) -> None:
    (tmp_path / "file").write_text("")
    elastic_run = str(Path(sys.executable).parent / "elastic-run")
    extra = ["--model-def", "examples/model_zoo/digits_cnn.py", "--training-data", "none-*"]
    extra = extra if command == "train" else []
    for value, message in (("", "is empty"), (str(tmp_path / "file"), "is not a directory")):
        args = [command, *extra, "--tensorboard-dir", value]
        if command == "run":
            args += ["--", "python", "tests/scripts/ea_elastic.py"]
        result = subprocess.run(
            [elastic_run, *args], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
    help_text = subprocess.run(
        [elastic_run, command, "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout
    assert "--tensorboard-dir DIR" in help_text


def test_the_directory_is_part_of_the_stored_job() -> None:
    config = JobConfig(JobSettings(1, 2, 1, 0), ("python", "/w/t.py"), None, "/w", "/tb")
    assert JobConfig.from_json("config/job", config.to_json()) == config
    older = {k: v for k, v in config.to_json().items() if k != "tensorboard_dir"}  # type: ignore[union-attr]
    assert JobConfig.from_json("config/job", older).tensorboard_dir is None
