"""The model-zoo interface without TensorFlow: the definition contract, the training flags, the
data paths, the output folder and the Kubernetes form of the training command."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.zoo import options
from elastic_allreduce.zoo.contract import PIECES, check_definition
from elastic_allreduce.zoo.loader import check_output_dir, expand_paths, import_model_def
from launcher import job_options
from launcher.zoo import RUNNER, in_cluster


def custom_model():
    return "model"


def loss(labels, predictions):
    return 0.0


def optimizer():
    return "optimizer"


def dataset_fn(dataset, mode):
    return dataset


GOOD = {
    "custom_model": custom_model,
    "loss": loss,
    "optimizer": optimizer,
    "dataset_fn": dataset_fn,
}


def test_a_complete_definition_is_accepted_with_its_optional_pieces() -> None:
    definition = check_definition("m.py", GOOD)
    assert definition.loss is loss and definition.eval_metrics_fn is None
    extended = check_definition(
        "m.py",
        {**GOOD, "eval_metrics_fn": dict, "callbacks": list, "learning_rate_schedule": abs},
    )
    assert extended.learning_rate_schedule is abs
    # Extra parameters with defaults, *args and **kwargs are fine.
    assert check_definition("m.py", {**GOOD, "loss": lambda y, p, weight=1.0: 0.0})
    assert check_definition("m.py", {**GOOD, "dataset_fn": lambda *args: None})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"custom_model": None}, "custom_model() is missing: define it, returning a tf.keras"),
        ({"loss": lambda labels: 0.0}, "loss(labels, predictions) cannot be called with 2"),
        ({"loss": lambda a, b, c: 0.0}, "missing a required argument: 'c'"),
        ({"optimizer": "adam"}, "optimizer() is a str, not a function"),
        ({"dataset_fn": lambda dataset: dataset}, "dataset_fn(dataset, mode) cannot be called"),
        ({"eval_metrics_fn": lambda x: {}}, "eval_metrics_fn() cannot be called with 0"),
        ({"learning_rate_schedule": 0.1}, "learning_rate_schedule(step) is a float"),
    ],
)
def test_each_bad_piece_is_one_clear_error_naming_the_definition_and_the_function(
    change: dict[str, object], message: str
) -> None:
    namespace = {**GOOD, **change}
    with pytest.raises(ConfigError) as caught:
        check_definition("zoo/bad.py", {k: v for k, v in namespace.items() if v is not None})
    assert str(caught.value).startswith("model definition zoo/bad.py: "), caught.value
    assert message in str(caught.value)


def test_every_problem_of_a_definition_is_listed_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        check_definition("m", {"loss": 3})
    text = str(caught.value)
    for name in ("custom_model()", "loss(labels, predictions) is a int", "optimizer()"):
        assert name in text
    assert [p.name for p in PIECES if p.required] == [
        "custom_model",
        "loss",
        "optimizer",
        "dataset_fn",
    ]


def test_a_definition_file_is_imported_with_its_folder_on_the_path(tmp_path: Path) -> None:
    (tmp_path / "helper_for_zoo_test.py").write_text("WIDTH = 7\n")
    source = "\n".join(
        [
            "from helper_for_zoo_test import WIDTH",
            "def custom_model(): return WIDTH",
            "def loss(labels, predictions): return 0.0",
            "def optimizer(): return None",
            "def dataset_fn(dataset, mode): return dataset",
        ]
    )
    (tmp_path / "zoo_test_def.py").write_text(source)
    definition = import_model_def(str(tmp_path / "zoo_test_def.py"))
    assert definition.custom_model() == 7
    assert definition.source_file == str(tmp_path / "zoo_test_def.py")


def test_a_definition_that_cannot_be_imported_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "broken_def.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"broken_def.py: importing it raised RuntimeError: boom"):
        import_model_def(str(tmp_path / "broken_def.py"))
    with pytest.raises(ConfigError, match="no such file"):
        import_model_def(str(tmp_path / "absent.py"))
    with pytest.raises(ConfigError, match="no such module or file"):
        import_model_def("no_such_module_for_the_zoo")


def _parse(*argv: str) -> options.TrainOptions:
    parser = argparse.ArgumentParser()
    options.add_train_flags(parser)
    return options.from_args(parser.parse_args(list(argv)))


def test_training_flags_round_trip_through_the_runner_command() -> None:
    cases = [
        ("--model-def", "m.py", "--training-data", "a.tfrecord"),
        (
            *("--model-def", "pkg.model", "--training-data", "a,b*", "--validation-data", "v"),
            *("--epochs", "3", "--max-steps", "40", "--batch-per-rank", "8", "--eval-every", "5"),
            *("--eval-batch", "32", "--commit-every", "4", "--output", "out", "--seed", "9"),
        ),
    ]
    for argv in cases:
        parsed = _parse(*argv)
        assert _parse(*options.to_args(parsed)) == parsed
    assert _parse(*cases[0]).global_batch == options.DEFAULT_GLOBAL_BATCH
    assert _parse(*cases[0]).policy == "fixed"
    assert _parse(*cases[1]).training_data == ("a", "b*")
    assert _parse(*cases[1]).policy == "linear"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--epochs", "0"), "--epochs must be at least 1, got 0"),
        (("--global-batch", "0"), "--global-batch must be at least 1"),
        (("--eval-every", "5"), "--eval-every needs --validation-data"),
        (("--output", " "), "--output is empty"),
    ],
)
def test_bad_training_flags_name_the_flag(extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _parse("--model-def", "m.py", "--training-data", "a", *extra)
    with pytest.raises(ConfigError, match="--training-data names no files"):
        _parse("--model-def", "m.py", "--training-data", " , ")


def test_data_patterns_expand_to_sorted_absolute_files_once(tmp_path: Path) -> None:
    for name in ("b.tfrecord", "a.tfrecord", "c.txt"):
        (tmp_path / name).write_bytes(b"")
    found = expand_paths([str(tmp_path / "*.tfrecord"), str(tmp_path / "a.tfrecord")], "--data")
    assert found == [str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")]
    with pytest.raises(ConfigError, match=r"--data: the pattern .* matches no file"):
        expand_paths([str(tmp_path / "*.none")], "--data")
    with pytest.raises(ConfigError, match="does not exist"):
        expand_paths([str(tmp_path / "gone.tfrecord")], "--data")
    with pytest.raises(ConfigError, match="is a folder"):
        expand_paths([str(tmp_path)], "--data")


def test_an_output_folder_must_be_new_or_empty(tmp_path: Path) -> None:
    check_output_dir(str(tmp_path / "new"))
    check_output_dir(str(tmp_path))
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        check_output_dir(str(tmp_path))
    with pytest.raises(ConfigError, match="is not a folder"):
        check_output_dir(str(tmp_path / "keep.txt"))


def test_a_train_command_for_kubernetes_becomes_the_runners_command() -> None:
    flags = ("--model-def", "/app/m.py", "--training-data", "/data/t-*", "--epochs", "2")
    job = in_cluster(job_options.job_options(("train", *flags), job_id="zoo-1"))
    assert job.command[:4] == ("python", "-m", RUNNER, "train")
    assert _parse(*job.command[4:]) == _parse(*flags)  # the pods' paths, unexpanded
    plain = job_options.job_options(("python", "train.py"), job_id="zoo-1")
    assert in_cluster(plain) == plain
    with pytest.raises(ConfigError, match="--epochs must be at least 1"):
        in_cluster(job_options.job_options(("train", *flags[:4], "--epochs", "0")))


def test_k8s_render_takes_a_train_command(capsys: pytest.CaptureFixture[str]) -> None:
    from launcher import cli  # noqa: PLC0415 - the whole CLI, only here

    flags = ("--model-def", "/app/m.py", "--training-data", "/data/t-*")
    assert (
        cli.main(
            ["k8s", "render", "--image", "reg/zoo:1", "--job-id", "zoo-1", "--", "train", *flags]
        )
        == 0
    )
    rendered = capsys.readouterr().out
    assert f"- {RUNNER}\n" in rendered and "- /app/m.py\n" in rendered
