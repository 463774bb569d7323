import dataclasses
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch

from functrain import tree
from functrain.data import CollateError, collate, empty_batch, num_examples
from functrain.data.collate import _collate_checked

Pair = namedtuple("Pair", ["image", "label"])


@tree.struct
class Example:
    x: torch.Tensor
    y: int


def test_nested_containers_keep_their_types_and_stack_leaves():
    samples = [
        {
            "pair": Pair(torch.full((2, 3), float(i)), i),
            "parts": (np.arange(3) + i, [float(i), True]),
            "name": f"s{i}",
            "nothing": None,
        }
        for i in range(4)
    ]
    batch = collate(samples)
    assert list(batch) == ["pair", "parts", "name", "nothing"]  # insertion order kept
    assert isinstance(batch["pair"], Pair)
    assert batch["pair"].image.shape == (4, 2, 3)
    assert torch.equal(batch["pair"].image[:, 0, 0], torch.arange(4.0))
    assert batch["pair"].label.dtype == torch.int64
    assert isinstance(batch["parts"], tuple) and isinstance(batch["parts"][1], list)
    assert torch.equal(batch["parts"][0], torch.from_numpy(np.stack([np.arange(3) + i for i in range(4)])))
    assert batch["parts"][1][0].dtype == torch.get_default_dtype()
    assert batch["parts"][1][1].dtype == torch.bool
    assert batch["name"] == ["s0", "s1", "s2", "s3"]
    assert batch["nothing"] is None
    assert num_examples(batch) == 4


def test_structs_and_numpy_scalars_collate():
    batch = collate([Example(torch.zeros(2), np.float32(1.5)), Example(torch.ones(2), np.float32(2.5))])
    assert isinstance(batch, Example)
    assert batch.y.dtype == torch.float32 and batch.y.tolist() == [1.5, 2.5]


def test_mixed_int_and_float_numbers_become_float():
    assert collate([1, 2.5]).dtype == torch.get_default_dtype()


def test_shape_mismatch_names_the_path_and_the_sample():
    samples = [{"inputs": Pair(torch.zeros(3), 0)}, {"inputs": Pair(torch.zeros(4), 1)}]
    with pytest.raises(
        CollateError, match=r"sample\['inputs'\]\.image has shape \(3,\) in sample 0 but \(4,\) in sample 1"
    ):
        collate(samples)


def test_uncollatable_type_names_path_and_type():
    class Image:
        pass

    with pytest.raises(CollateError, match=r"sample\['img'\]\[1\] of type .*Image.*convert it"):
        collate([{"img": [1, Image()]}, {"img": [2, Image()]}])


def test_missing_key_is_reported():
    with pytest.raises(CollateError, match=r"sample 1 .*missing \[\"sample\['y'\]\"\]"):
        collate([{"x": 1, "y": 2}, {"x": 1}])


def test_mixed_leaf_types_are_reported():
    with pytest.raises(
        CollateError, match=r"sample\[1\] is a torch.Tensor in sample 0 but a int in sample 2"
    ):
        collate([(0, torch.zeros(1)), (1, torch.zeros(1)), (2, 3)])


def test_object_numpy_arrays_are_rejected():
    with pytest.raises(CollateError, match="dtype object"):
        collate([np.array(["a", None], dtype=object)] * 2)


def test_empty_input_is_an_error_and_empty_batch_keeps_the_structure():
    with pytest.raises(CollateError, match="no samples"):
        collate([])
    sample = {"x": torch.zeros(2, 3, dtype=torch.float16), "y": 1, "z": np.zeros(2), "name": "a"}
    empty = empty_batch(sample)
    assert empty["x"].shape == (0, 2, 3) and empty["x"].dtype == torch.float16
    assert empty["y"].shape == (0,) and empty["y"].dtype == torch.int64
    assert empty["z"].shape == (0, 2) and empty["z"].dtype == torch.float64
    assert empty["name"] == []
    assert num_examples(empty) == 0
    no_strings = {k: v for k, v in sample.items() if k != "name"}
    assert tree.structure(empty_batch(no_strings)) == tree.structure(collate([no_strings, no_strings]))


def test_num_examples_skips_structural_lists():
    assert num_examples([torch.zeros(5), torch.zeros(5)]) == 5
    assert num_examples({"name": ["a", "b", "c"]}) == 3


@tree.struct
class Tagged:
    x: torch.Tensor
    tag: str = tree.field(static=True, default="a")


KINDS = {
    "dict of tensors": lambda i, rows: {"x": torch.full((3,), float(i)), "y": torch.tensor(i)},
    "keys in another order": lambda i, rows: (
        {"x": torch.zeros(2) + i, "y": i} if i % 2 else {"y": i, "x": torch.zeros(2)}
    ),
    "tuple of numbers": lambda i, rows: (i, i / 2, i % 2 == 0, np.int32(i), np.float64(i)),
    "hf-style": lambda i, rows: {
        "input_ids": torch.arange(5) + i,
        "attention_mask": torch.ones(5, dtype=torch.long),
    },
    "numpy and memmap rows": lambda i, rows: {"x": np.arange(4.0) * i, "row": rows[i], "label": np.int64(i)},
    "nested": lambda i, rows: [{"pair": Pair(torch.ones(2) * i, [i, "s"]), "none": None}, (b"raw", "text")],
    "ints then floats": lambda i, rows: {"v": i if i < 2 else i + 0.5},
    "struct": lambda i, rows: Example(torch.ones(1) * i, i),
    "struct with a static field": lambda i, rows: Tagged(torch.ones(1) * i),
    "OrderedDict": lambda i, rows: OrderedDict(b=torch.tensor(i), a=i),
    "empty containers": lambda i, rows: {"t": (), "l": [], "d": {}, "x": torch.zeros(1)},
}


def assert_same_batch(a, b):
    """The same container types, key order and leaves (type, dtype, values), recursively."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same_batch(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_batch(x, y)
    elif tree.is_struct(a):
        for field in dataclasses.fields(a):
            assert_same_batch(getattr(a, field.name), getattr(b, field.name))
    else:
        assert a == b


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_fast_path_gives_the_careful_paths_batch(kind, tmp_path):
    rows = np.lib.format.open_memmap(tmp_path / "rows.npy", dtype=np.float32, mode="w+", shape=(4, 3))
    rows[:] = np.arange(12).reshape(4, 3)
    samples = [KINDS[kind](i, rows) for i in range(4)]
    assert_same_batch(collate(samples), _collate_checked(samples))


def _collate_in_worker(samples):
    batch = collate(samples)
    return batch, {key: leaf.is_shared() for key, leaf in batch.items()}


def test_in_a_worker_the_batch_is_stacked_into_shared_memory():
    # As default_collate does: the batch is then not copied into shared memory again to reach the loop.
    samples = [{"x": torch.full((3,), float(i)), "row": np.arange(4.0) + i, "y": i} for i in range(8)]
    samples[7]["x"] = samples[7]["x"].double()  # mixed dtypes: promoted, as in this process
    loader = torch.utils.data.DataLoader(samples, batch_size=4, num_workers=1, collate_fn=_collate_in_worker)
    (first, shared), (second, _) = loader
    assert shared["x"] and shared["row"]
    assert_same_batch(first, collate(samples[:4]))
    assert_same_batch(second, collate(samples[4:]))
    assert second["x"].dtype == torch.float64
    assert not collate(samples)["row"].is_shared()  # in this process: plain memory
