"""Exactly-once elastic sharding (pure logic), including random resize and rollback schedules."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_allreduce.data import EpochSharding, global_batch_for
from elastic_allreduce.errors import ConfigError


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
