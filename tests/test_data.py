"""Exactly-once elastic sharding (pure logic), including random resize and rollback schedules."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from elastic_allreduce.errors import ConfigError
from elastic_allreduce.training.data import (
    ArraySource,
    EpochSharding,
    RecordSource,
    TFRecordSource,
    global_batch_for,
)


def test_the_order_is_a_deterministic_permutation_per_seed_and_epoch() -> None:
    sharding = EpochSharding(num_samples=100, seed=7)
    first = sharding.order(0)
    assert sorted(first.tolist()) == list(range(100))
    assert np.array_equal(first, EpochSharding(num_samples=100, seed=7).order(0))
    assert not np.array_equal(first, sharding.order(1))
    assert not np.array_equal(first, EpochSharding(num_samples=100, seed=8).order(0))
    assert EpochSharding(10, seed=1, shuffle=False).order(3).tolist() == list(range(10))


def test_shares_split_a_step_contiguously_and_cover_it_once() -> None:
    sharding = EpochSharding(num_samples=50, seed=3)
    shares = [sharding.share(0, 10, global_batch=11, rank=r, size=3) for r in range(3)]
    assert [len(s.ids) for s in shares if s] == [4, 4, 3]
    joined = np.concatenate([s.ids for s in shares if s])
    assert np.array_equal(joined, sharding.order(0)[10:21])
    assert {s.global_size for s in shares if s} == {11}
    # Weighted averaging of per-rank means equals the mean over the global batch.
    scales = [s.gradient_scale(3) for s in shares if s]
    assert sum(scales) / 3 == pytest.approx(1.0)


def test_the_last_partial_batch_is_kept_unless_dropped() -> None:
    kept = EpochSharding(num_samples=10, seed=0, shuffle=False)
    last = [kept.share(0, 8, global_batch=4, rank=r, size=3) for r in range(3)]
    assert [s.ids.tolist() for s in last if s] == [[8], [9], []]
    assert kept.steps_left(0, 4) == 3
    assert kept.share(0, 10, 4, 0, 1) is None
    dropped = EpochSharding(num_samples=10, seed=0, shuffle=False, drop_remainder=True)
    assert dropped.share(0, 8, 4, 0, 3) is None
    assert dropped.steps_left(0, 4) == 2


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_is_applied_exactly_once_under_random_resizes_and_rollbacks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sharding = EpochSharding(num_samples=int(rng.integers(1, 400)), seed=seed)
    policy = "fixed" if seed % 2 else "linear"
    for epoch in range(2):
        committed, position = 0, 0
        applied: list[int] = []
        pending: list[int] = []  # ids of steps since the last commit
        while True:
            size = int(rng.integers(1, 6))
            batch = global_batch_for(
                policy, int(rng.integers(1, 9)), int(rng.integers(1, 40)), size
            )
            shares = [sharding.share(epoch, position, batch, r, size) for r in range(size)]
            if shares[0] is None:
                break
            pending += [int(i) for s in shares if s for i in s.ids]
            position += shares[0].global_size
            event = rng.random()
            if event < 0.2:  # a rank died before the next commit: roll back
                position, pending = committed, []
            elif event < 0.6:  # commit
                committed, applied, pending = position, applied + pending, []
        applied += pending
        assert sorted(applied) == list(range(sharding.num_samples)), (epoch, policy)


def test_bad_arguments_are_rejected_clearly() -> None:
    with pytest.raises(ConfigError, match="at least one sample"):
        EpochSharding(num_samples=0, seed=1)
    with pytest.raises(ConfigError, match="bad share request"):
        EpochSharding(num_samples=5, seed=1).share(0, 0, 2, rank=3, size=3)
    with pytest.raises(ConfigError, match="unknown batch policy"):
        global_batch_for("cubic", 1, None, 2)
    with pytest.raises(ConfigError, match="needs global_batch"):
        global_batch_for("fixed", 1, None, 2)


# -- sources ------------------------------------------------------------------------------------


def test_an_array_source_fetches_the_ids_in_the_order_given() -> None:
    features = np.arange(20, dtype=np.float32).reshape(10, 2)
    source = ArraySource(features, np.arange(10))
    x, y = source.fetch(np.array([7, 2, 7], dtype=np.int64))
    assert y.tolist() == [7, 2, 7] and x[:, 0].tolist() == [14.0, 4.0, 14.0]
    assert len(source) == 10
    with pytest.raises(ConfigError, match="differ in length"):
        ArraySource(features, np.arange(9))


def test_a_record_source_reads_only_the_records_it_is_asked_for() -> None:
    class Files:
        """An indexable collection that loads one record per access (like files on disk)."""

        def __init__(self) -> None:
            self.loaded: list[int] = []

        def __len__(self) -> int:
            return 50

        def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
            self.loaded.append(index)
            return np.full(3, index, np.float32), index % 4

    files = Files()
    source = RecordSource(files)
    files.loaded.clear()
    x, y = source.fetch(np.array([9, 4], dtype=np.int64))
    assert files.loaded == [9, 4]
    assert x.shape == (2, 3) and x[:, 0].tolist() == [9.0, 4.0] and y.tolist() == [1, 0]
    empty_x, empty_y = source.fetch(np.array([], dtype=np.int64))
    assert empty_x.shape == (0, 3) and empty_y.shape == (0,)
    with pytest.raises(ConfigError, match="not a non-empty tuple"):
        RecordSource(["just a string"])


def write_tfrecords(directory: Path, blocks: list[list[bytes]]) -> list[Path]:
    import tensorflow as tf  # noqa: PLC0415 - only these tests need TensorFlow

    paths = []
    for number, block in enumerate(blocks):
        path = directory / f"part-{number}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for record in block:
                writer.write(record)
        paths.append(path)
    return paths


def test_tfrecord_shards_are_addressed_by_id_across_files(tmp_path: Path) -> None:
    blocks = [[f"a{i}".encode() * (i + 1) for i in range(3)], [], [b"b0", b"", b"b2" * 500]]
    paths = write_tfrecords(tmp_path, blocks)
    source = TFRecordSource(paths, counts=[3, 0, 3])
    everything = [record for block in blocks for record in block]
    assert len(source) == len(everything)
    order = np.array([5, 0, 4, 2, 3, 1], dtype=np.int64)
    (records,) = source.fetch(order)
    assert list(records) == [everything[i] for i in order]
    source.close()
    with pytest.raises(ConfigError, match="holds 3 records, not the 4 given"):
        TFRecordSource(paths, counts=[4, 0, 3])
    with pytest.raises(ConfigError, match="one count per file"):
        TFRecordSource(paths, counts=[3])


def test_a_compressed_or_foreign_file_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    (path,) = write_tfrecords(tmp_path, [[b"x" * 100] * 5])
    compressed = tmp_path / "part.tfrecord.gz"
    compressed.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(ConfigError, match="not an uncompressed TFRecord file"):
        TFRecordSource([compressed])
    with pytest.raises(ConfigError, match="cannot read TFRecord file"):
        TFRecordSource([tmp_path / "missing.tfrecord"])
    with pytest.raises(ConfigError, match="no TFRecord files"):
        TFRecordSource([])
