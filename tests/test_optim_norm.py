"""Norms and in-place updates are arguments of the optimizer, not settings: ``update(..., norm=fn)`` and
``apply_gradients(..., norm=, in_place=)`` (a sharded step passes its all-reducing norm this way)."""

from __future__ import annotations

import pytest
import torch

from functrain import optim, tree
from functrain.core import foreach


def _doubled(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """A stand-in for a sharded step's norm: every leaf counted twice (as two ranks holding equal rows)."""
    return [n * 2 for n in foreach.norm(leaves)]


def _shifted(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """A norm that changes ratios of norms too (LAMB's trust ratio is unchanged by a common factor)."""
    return [n + 1 for n in foreach.norm(leaves)]


def _updates() -> dict[str, torch.Tensor]:
    return {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}


def test_clip_by_global_norm_takes_the_norm_as_an_argument() -> None:
    tx = optim.clip_by_global_norm(1.0)
    local, _ = tx.update(_updates(), tx.init({}))
    doubled, _ = tx.update(_updates(), tx.init({}), norm=_doubled)
    torch.testing.assert_close(local["b"], torch.tensor([4.0 / (5.0 + 1e-6)]))
    torch.testing.assert_close(doubled["b"], torch.tensor([4.0 / (10.0 + 1e-6)]))
    assert tree.global_norm(_updates(), _doubled) == 10.0


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: optim.chain(optim.scale(1.0), tx),
        lambda tx: optim.masked(tx, {"a": True, "b": True}),
        lambda tx: optim.freeze(tx, {"a": False, "b": False}),
        lambda tx: optim.multi_transform({"x": tx}, {"a": "x", "b": "x"}),
        lambda tx: optim.skip_not_finite(tx),
    ],
    ids=["chain", "masked", "freeze", "multi_transform", "skip_not_finite"],
)
def test_wrappers_forward_the_norm(wrap) -> None:  # type: ignore[no-untyped-def]
    tx = wrap(optim.clip_by_global_norm(1.0))
    params = {"a": torch.zeros(1), "b": torch.zeros(1)}
    out, _ = tx.update(_updates(), tx.init(params), params, norm=_doubled)
    torch.testing.assert_close(out["b"], torch.tensor([4.0 / (10.0 + 1e-6)]))


def test_apply_gradients_passes_the_norm_to_clipping_and_lamb() -> None:
    params = {"a": torch.ones(1), "b": torch.ones(1)}
    for tx in (
        optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(1.0)),
        optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1.0, weight_decay=0.0)),
        optim.lamb(1.0),
    ):
        local = optim.apply_gradients(tx, _updates(), tx.init(params), params)
        shifted = optim.apply_gradients(tx, _updates(), tx.init(params), params, norm=_shifted)
        # Adam's step is scale-free: its first moment shows the clipped gradient
        differ = [not torch.equal(x, y) for x, y in zip(tree.leaves(local), tree.leaves(shifted))]
        assert any(differ)


def test_a_transform_without_a_norm_parameter_is_called_as_before() -> None:
    plain = optim.GradientTransformation(
        init=lambda params: optim.EmptyState(),
        update=lambda updates, state, params=None: (updates, state),
    )
    assert not optim.base.takes_norm(plain)
    tx = optim.chain(plain, optim.clip_by_global_norm(1.0))
    out, _ = tx.update(_updates(), tx.init({}), norm=_doubled)
    torch.testing.assert_close(out["b"], torch.tensor([4.0 / (10.0 + 1e-6)]))


@pytest.mark.parametrize("in_place", [False, True])
def test_fused_adam_writes_into_the_params_only_when_asked(in_place: bool) -> None:
    tx = optim.adamw(0.1, weight_decay=0.1)
    params = {"w": torch.ones(3)}
    before = params["w"].clone()
    new, _ = optim.apply_gradients(tx, {"w": torch.ones(3)}, tx.init(params), params, in_place=in_place)
    assert (new["w"] is params["w"]) == in_place
    assert torch.equal(params["w"], new["w"] if in_place else before)


def test_fused_adamw_reads_the_decay_from_the_chain_state_masked_or_not() -> None:
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    grads = {"w": torch.ones(2), "b": torch.ones(2)}
    for mask in (None, {"w": True, "b": False}):
        fused = optim.adamw(0.1, weight_decay=0.5, mask=mask)
        unfused = optim.adamw(0.1, weight_decay=0.5, mask=mask, fused=False)
        state = optim.set_hyperparams(fused.init(params), weight_decay=0.25)
        ours, _ = optim.apply_gradients(fused, grads, state, params)
        reference, _ = optim.apply_gradients(unfused, grads, state, params)
        for k in params:
            torch.testing.assert_close(ours[k], reference[k])


def test_foreach_ops_run_per_tensor_on_vmapped_arguments_only() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    out = torch.func.vmap(lambda row: torch.stack(foreach.mul([row, row], 2.0)))(x)
    torch.testing.assert_close(out, torch.stack([x * 2, x * 2], dim=1))
    assert not foreach.batched([x])
    assert torch.func.vmap(lambda row: torch.tensor(foreach.batched([row])))(x).all()
