"""skip_not_finite, all_finite, and clipping against torch.nn.utils."""

from __future__ import annotations

import pytest
import torch

from functrain import optim


def test_all_finite() -> None:
    assert bool(optim.all_finite({"a": torch.ones(2), "b": torch.zeros(3)}))
    assert not bool(optim.all_finite({"a": torch.ones(2), "b": torch.tensor([0.0, float("nan")])}))
    assert not bool(optim.all_finite([torch.tensor([-float("inf")])]))
    assert bool(optim.all_finite({}))


def test_skip_not_finite_skips_and_counts() -> None:
    params = {"w": torch.ones(2)}
    tx = optim.skip_not_finite(optim.adam(0.1))
    state = tx.init(params)
    good = {"w": torch.ones(2)}
    bad = {"w": torch.tensor([1.0, float("inf")])}
    nan = {"w": torch.tensor([float("nan"), 1.0])}

    updates, state = tx.update(good, state, params)
    assert bool(state.last_finite) and int(state.inner_state[0].count) == 1
    adam_after_good = state.inner_state[0]

    for grads in (bad, nan):
        updates, state = tx.update(grads, state, params)
        assert torch.equal(updates["w"], torch.zeros(2))
        assert not bool(state.last_finite)
        assert int(state.inner_state[0].count) == 1  # inner state kept
        assert torch.equal(state.inner_state[0].mu["w"], adam_after_good.mu["w"])
    assert int(state.notfinite_count) == 2 and int(state.total_notfinite) == 2

    updates, state = tx.update(good, state, params)
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 2
    assert int(state.inner_state[0].count) == 2
    assert torch.isfinite(updates["w"]).all() and not torch.equal(updates["w"], torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_by_global_norm_matches_clip_grad_norm_(dtype: torch.dtype) -> None:
    # float64 too: the norm was taken in float32 whatever the leaves, so a float64 run's clipped
    # gradients were 1e-8 off torch's (the tensor-parallel parity tests met it)
    torch.manual_seed(0)
    grads = {"a": torch.randn(5, 4, dtype=dtype) * 3, "b": torch.randn(7, dtype=dtype)}
    for max_norm in (0.5, 1e3):
        tensors = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
        for t, g in zip(tensors, grads.values()):
            t.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(tensors, max_norm)
        tx = optim.clip_by_global_norm(max_norm)
        clipped, _ = tx.update(grads, tx.init(grads))
        for t, key in zip(tensors, grads):  # exact: the same eager kernels in the same order on any CPU
            torch.testing.assert_close(clipped[key], t.grad, rtol=0, atol=0)


def test_clip_matches_clip_grad_value_() -> None:
    g = torch.randn(20) * 3
    p = torch.nn.Parameter(torch.zeros(20))
    p.grad = g.clone()
    torch.nn.utils.clip_grad_value_([p], 1.5)
    clipped, _ = optim.clip(1.5).update({"g": g}, optim.EmptyState())
    assert torch.equal(clipped["g"], p.grad)


def test_clip_rejects_negative() -> None:
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_by_global_norm(-1.0)
