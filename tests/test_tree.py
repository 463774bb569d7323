"""functrain.tree.keep_where: the new tree where a predicate holds, the old one elsewhere (torch.where)."""

from __future__ import annotations

import collections

import optree
import pytest
import torch

from functrain import optim, tree


@pytest.mark.parametrize("holds", [True, False])
def test_keep_where_picks_each_tensor_leaf_and_keeps_new_non_tensor_leaves(holds):
    new = {"w": torch.randn(3, 2), "opt": (torch.randn(2), 7), "count": torch.tensor(5), "none": None}
    old = {"w": torch.randn(3, 2), "opt": (torch.randn(2), 0), "count": torch.tensor(4), "none": None}
    out = tree.keep_where(torch.tensor(holds), new, old)
    pick = new if holds else old
    assert torch.equal(out["w"], pick["w"]) and torch.equal(out["opt"][0], pick["opt"][0])
    assert torch.equal(out["count"], pick["count"]) and out["opt"][1] == 7 and out["none"] is None


def test_keep_where_broadcasts_a_predicate_per_row():
    rows = torch.tensor([True, False, True])
    new, old = {"w": torch.ones(3, 2)}, {"w": torch.zeros(3, 2)}
    expected = torch.where(rows[:, None], new["w"], old["w"])
    assert torch.equal(tree.keep_where(rows[:, None], new, old)["w"], expected)


def test_keep_where_works_in_a_struct_state_as_skip_not_finite_uses_it():
    tx = optim.skip_not_finite(optim.adam(0.1))
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(2)}, state, params)
    _, skipped = tx.update({"w": torch.tensor([1.0, float("nan")])}, state, params)
    before, after = tree.leaves(state.inner_state), tree.leaves(skipped.inner_state)
    assert len(before) == len(after) > 0 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert int(skipped.notfinite_count) == 1


@pytest.mark.parametrize("holds", [True, False])
def test_keep_where_eagerly_on_the_cpu_returns_the_kept_tensors_without_a_where_per_leaf(holds):
    # reading a 0-d CPU predicate costs no device sync: no torch.where (a copy) per leaf on the cheap tier
    new = {"w": torch.randn(3, 2), "opt": (torch.randn(2), 7)}
    old = {"w": torch.randn(3, 2), "opt": (torch.randn(2), 0)}
    out = tree.keep_where(torch.tensor(holds), new, old)
    pick = new if holds else old
    assert out["w"] is pick["w"] and out["opt"][0] is pick["opt"][0] and out["opt"][1] == 7
    assert (out is new) == holds


def test_keep_where_under_a_transform_or_a_compile_stays_a_where():
    new, old = {"w": torch.ones(2, 3)}, {"w": torch.zeros(2, 3)}
    preds = torch.tensor([True, False])
    per_member = torch.vmap(lambda p, n, o: tree.keep_where(p, {"w": n}, {"w": o})["w"])(
        preds, new["w"], old["w"]
    )
    assert per_member.tolist() == [[1.0] * 3, [0.0] * 3]
    # differentiable as torch.where: the gradient flows to the kept tree only
    grad = torch.func.grad(lambda n: tree.keep_where(torch.tensor(False), {"w": n}, old)["w"].sum())(new["w"])
    assert torch.equal(grad, torch.zeros(2, 3))


@tree.struct
class _Pair:
    a: torch.Tensor
    b: object
    how: str = tree.field(static=True, default="x")


class _PairSubclass(_Pair):  # not registered: a leaf to optree
    pass


def test_leaves_and_replace_while_tracing_are_optrees_and_dataclasses():
    # Traced, tree.leaves walks tuples, lists, str-keyed dicts and structs itself, and replace reads a
    # struct's fields itself: the same leaves in the same order, the same struct, as eagerly.
    point = collections.namedtuple("point", "y x")

    def t(value: float) -> torch.Tensor:
        return torch.tensor([float(value)])

    nested = (
        [t(1), None, {"b": t(2), "a": (t(3), 4)}],
        _Pair(t(5), {"z": t(6), "c": None}),
        _PairSubclass(t(7), 8),
        point(t(9), t(10)),
        collections.OrderedDict([("q", t(11)), ("p", t(12))]),
        {2: t(13), 1: t(14)},
        (),
        t(15),
    )

    def traced(nested):
        return tree.leaves(nested), nested[1].replace(a=nested[1].a * 2).replace(b=3)

    torch._dynamo.reset()
    leaves, replaced = torch.compile(traced, backend="eager", fullgraph=True)(nested)
    expected = optree.tree_leaves(nested, namespace=tree.NAMESPACE)
    assert len(leaves) == len(expected) == 14
    assert all(
        x is y if not isinstance(y, torch.Tensor) else torch.equal(x, y) for x, y in zip(leaves, expected)
    )
    assert (
        type(replaced) is _Pair and torch.equal(replaced.a, t(10)) and replaced.b == 3 and replaced.how == "x"
    )
    walked = tree._traced_leaves(nested)  # the walk itself, eagerly: the same objects
    assert len(walked) == len(expected) and all(x is y for x, y in zip(walked, expected))
