"""freeze / masked / multi_transform semantics and the name- and index-based mask builders."""

from __future__ import annotations

import re

import pytest
import torch

from functrain import optim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
    )


def _params() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model().named_parameters()}


def _ones_like(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(v) for k, v in params.items()}


def test_freeze_gives_zero_updates_and_no_state_for_frozen_leaves() -> None:
    params = _params()
    frozen = optim.mask_by_name(params, "0.*")
    tx = optim.freeze(optim.adamw(0.1, weight_decay=0.5), frozen)
    state = tx.init(params)
    adam_state = state.inner_state[0]
    assert adam_state.mu["0.weight"] is None and adam_state.mu["3.weight"] is not None
    updates, _ = tx.update(_ones_like(params), state, params)
    assert torch.equal(updates["0.weight"], torch.zeros(4, 3))
    assert torch.equal(updates["0.bias"], torch.zeros(4))
    reference = optim.adamw(0.1, weight_decay=0.5)
    ref_updates, _ = reference.update(_ones_like(params), reference.init(params), params)
    torch.testing.assert_close(updates["3.weight"], ref_updates["3.weight"], rtol=0, atol=0)


def test_masked_passes_other_leaves_through_unchanged() -> None:
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    tx = optim.masked(optim.scale(3.0), {"a": True, "b": False})
    grads = {"a": torch.full((2,), 2.0), "b": torch.full((2,), 5.0)}
    updates, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(updates["a"], torch.full((2,), 6.0))
    assert torch.equal(updates["b"], grads["b"])  # unchanged, not zero


def test_adamw_mask_limits_weight_decay() -> None:
    params = {"w": torch.full((2,), 2.0), "bias": torch.full((2,), 2.0)}
    tx = optim.adamw(0.1, weight_decay=0.5, mask=lambda p: optim.mask_by_name(p, "w"))
    updates, _ = tx.update({"w": torch.zeros(2), "bias": torch.zeros(2)}, tx.init(params), params)
    assert torch.allclose(updates["w"], torch.full((2,), -0.1 * 0.5 * 2.0))
    assert torch.equal(updates["bias"], torch.zeros(2))


def test_multi_transform_runs_each_group_with_its_transform() -> None:
    params = _params()
    labels = optim.labels_by_name(params, {"3.*": "head", "1.*": "frozen"}, default="body")
    assert labels["3.bias"] == "head" and labels["1.weight"] == "frozen" and labels["0.weight"] == "body"
    tx = optim.multi_transform(
        {"head": optim.sgd(1.0), "body": optim.sgd(0.1), "frozen": optim.set_to_zero()}, labels
    )
    updates, _ = tx.update(_ones_like(params), tx.init(params), params)
    assert torch.allclose(updates["3.weight"], torch.full((2, 4), -1.0))
    assert torch.allclose(updates["0.bias"], torch.full((4,), -0.1))
    assert torch.equal(updates["1.weight"], torch.zeros(4))


def test_multi_transform_unknown_label_names_leaf_and_labels() -> None:
    params = {"a": torch.ones(1), "b": torch.ones(1)}
    tx = optim.multi_transform({"x": optim.sgd(0.1)}, {"a": "x", "b": "y"})
    with pytest.raises(ValueError, match=r"'b' has label 'y'.*\['x'\]"):
        tx.init(params)


def test_mask_that_does_not_match_the_params_is_an_error() -> None:
    tx = optim.freeze(optim.sgd(0.1), {"a": True})
    with pytest.raises(ValueError, match="does not match the params"):
        tx.init({"a": torch.ones(1), "b": torch.ones(1)})
    tx = optim.freeze(optim.sgd(0.1), {"a": 1})
    with pytest.raises(TypeError, match="'a' is int"):
        tx.init({"a": torch.ones(1)})


def test_patterns_that_match_nothing_are_errors() -> None:
    params = _params()
    with pytest.raises(ValueError, match=r"'backbone\.\*' matches no parameter.*0\.weight"):
        optim.mask_by_name(params, "backbone.*")
    with pytest.raises(ValueError, match="matches no parameter"):
        optim.labels_by_name(params, {re.compile(r"0\.w"): "x"})  # regex must match the whole name
    assert optim.mask_by_name(params, re.compile(r"\d\.bias"))["3.bias"] is True


def test_names_by_module_index_like_layer_freezer_by_idx() -> None:
    model = _model()
    assert optim.names_by_module_index(model, [0, -1]) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    with pytest.raises(IndexError, match="4 children"):
        optim.names_by_module_index(model, 4)
    with pytest.raises(ValueError, match="ReLU"):
        optim.names_by_module_index(model, 2)


def test_batchnorm_param_names_for_freeze_bn() -> None:
    assert optim.batchnorm_param_names(_model()) == ["1.weight", "1.bias"]
    with pytest.raises(ValueError, match="no batch-norm"):
        optim.batchnorm_param_names(torch.nn.Linear(2, 2))


def test_nested_freeze_inside_multi_transform_with_full_size_mask() -> None:
    params = _params()
    decay_mask = optim.mask_by_name(params, "*.weight")  # full size, used inside a group
    tx = optim.multi_transform(
        {
            "trained": optim.adamw(0.1, weight_decay=0.1, mask=decay_mask),
            "frozen": optim.set_to_zero(),
        },
        optim.labels_by_name(
            params, {optim.names_by_module_index(_model(), 0)[0]: "frozen"}, default="trained"
        ),
    )
    updates, _ = tx.update(_ones_like(params), tx.init(params), params)
    assert torch.equal(updates["0.weight"], torch.zeros(4, 3))
    assert not torch.equal(updates["0.bias"], torch.zeros(4))
