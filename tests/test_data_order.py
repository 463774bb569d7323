from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functrain import random
from functrain.data import epoch_order, shard_batches


def test_order_is_the_documented_permutation():
    key = random.key(3)
    expected = torch.randperm(50, generator=random.generator(random.fold_in(key, 4))).tolist()
    assert epoch_order(50, 4, key) == expected


def test_epochs_differ_and_the_same_key_repeats():
    key = random.key(0)
    assert epoch_order(100, 0, key) != epoch_order(100, 1, key)
    assert epoch_order(100, 1, key) == epoch_order(100, 1, random.key(0))
    assert epoch_order(100, 1, key) != epoch_order(100, 1, random.key(1))
    assert sorted(epoch_order(100, 1, key)) == list(range(100))


def test_shuffle_needs_a_key():
    with pytest.raises(ValueError, match="needs a key"):
        epoch_order(5, 0, None)
    assert epoch_order(5, 0, None, shuffle=False) == [0, 1, 2, 3, 4]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 60),
    batch_size=st.integers(1, 7),
    world_size=st.integers(1, 5),
    drop_last=st.booleans(),
)
def test_ranks_cover_each_example_once_with_equal_batch_counts(n, batch_size, world_size, drop_last):
    order = list(reversed(range(n)))
    per_rank = [
        shard_batches(order, batch_size, drop_last=drop_last, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    assert len({len(batches) for batches in per_rank}) == 1  # all ranks step together
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert all(count == 1 for count in seen.values())  # nothing duplicated
    per_step = batch_size * world_size
    if drop_last:
        assert sorted(seen) == sorted(order[: n // per_step * per_step])
        assert all(len(b) == batch_size for batches in per_rank for b in batches)
    else:
        assert sorted(seen) == list(range(n))  # nothing dropped
    for step in range(len(per_rank[0])):  # a step sees what one process with batch size G would see
        together = [i for batches in per_rank for i in batches[step]]
        assert together == order[step * per_step : (step + 1) * per_step]
        sizes = [len(batches[step]) for batches in per_rank]
        assert max(sizes) - min(sizes) <= 1 or sizes == [batch_size] * world_size


def test_the_final_short_step_is_spread_evenly_and_can_leave_a_rank_empty():
    shares = [shard_batches([0, 1, 2, 3, 4], 2, rank=r, world_size=4) for r in range(4)]
    assert shares == [[[0, 1]], [[2]], [[3]], [[4]]]
    shares = [shard_batches(list(range(11)), 2, rank=r, world_size=4) for r in range(4)]
    assert shares == [[[0, 1], [8]], [[2, 3], [9]], [[4, 5], [10]], [[6, 7], []]]


def test_rank_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="rank"):
        shard_batches([0, 1], 1, rank=2, world_size=2)
