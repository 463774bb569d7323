"""functrain.tree.keep_where: the new tree where a predicate holds, the old one elsewhere (torch.where)."""

from __future__ import annotations

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
