import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from functrain import tree
from functrain.data import DataPosition, num_batches, num_steps


def test_fields_are_0d_int64_cpu_tensors():
    position = DataPosition(epoch=2, index=5)
    for leaf in tree.leaves(position):
        assert isinstance(leaf, torch.Tensor)
        assert leaf.dtype == torch.int64 and leaf.shape == () and leaf.device.type == "cpu"
    assert position.as_tuple() == (2, 5)
    assert repr(position) == "DataPosition(epoch=2, index=5)"


def test_is_a_pytree_with_two_leaves_that_rebuilds():
    position = DataPosition(1, 3)
    doubled = tree.map(lambda x: x * 2, position)
    assert isinstance(doubled, DataPosition)
    assert doubled.as_tuple() == (2, 6)


@pytest.mark.parametrize("field", ["epoch", "index"])
def test_rejects_negative_and_bool(field):
    with pytest.raises(ValueError, match=field):
        DataPosition(**{field: -1})
    with pytest.raises(TypeError, match=field):
        DataPosition(**{field: True})


@given(count=st.integers(0, 500), per_epoch=st.integers(1, 20))
def test_batch_count_round_trip(count, per_epoch):
    position = DataPosition.from_batch_count(count, per_epoch)
    epoch, index = position.as_tuple()
    assert position.batch_count(per_epoch) == count
    assert 0 <= index <= per_epoch
    assert (index == 0) == (count == 0)  # an epoch end is (e, per_epoch), never (e + 1, 0)
    assert DataPosition(epoch, index).advance(per_epoch, 3).batch_count(per_epoch) == count + 3


def test_normalized_moves_a_finished_epoch_to_the_next_start():
    assert DataPosition(2, 5).normalized(5).as_tuple() == (3, 0)
    assert DataPosition(2, 4).normalized(5).as_tuple() == (2, 4)
    with pytest.raises(ValueError, match="index=6 is past the end"):
        DataPosition(2, 6).normalized(5)


@given(
    n=st.integers(0, 200),
    batch_size=st.integers(1, 16),
    drop_last=st.booleans(),
    world_size=st.integers(1, 8),
)
def test_num_batches_matches_a_direct_count(n, batch_size, drop_last, world_size):
    per_step = batch_size * world_size
    steps = [s for s in range(0, n, per_step) if not drop_last or s + per_step <= n]
    assert num_batches(n, batch_size, drop_last, world_size) == len(steps)


def test_num_steps_counts_a_trailing_partial_accumulation():
    assert num_steps(8, 4) == 2
    assert num_steps(9, 4) == 3
    assert num_steps(0, 4) == 0
    with pytest.raises(ValueError, match="accumulation_steps"):
        num_steps(8, 0)


def test_num_batches_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        num_batches(10, 0)
    with pytest.raises(ValueError, match="world_size"):
        num_batches(10, 2, world_size=0)
    with pytest.raises(ValueError, match="dataset_len"):
        num_batches(-1, 2)
