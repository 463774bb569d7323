"""hyperparams / set_hyperparams: found anywhere in the state, used by the next update, clear errors."""

from __future__ import annotations

import pytest
import torch

from functrain import optim


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(3), "b": torch.zeros(1)}


def test_set_learning_rate_is_used_by_the_next_update() -> None:
    tx = optim.sgd(0.1)
    state = tx.init(_params())
    grads = {"w": torch.ones(3), "b": torch.ones(1)}
    updates, state = tx.update(grads, state)
    assert torch.allclose(updates["w"], torch.full((3,), -0.1))
    state = optim.set_hyperparams(state, learning_rate=0.5)
    updates, _ = tx.update(grads, state)
    assert torch.allclose(updates["w"], torch.full((3,), -0.5))


def test_set_hyperparams_returns_a_new_state_of_same_dtype() -> None:
    state = optim.adamw(1e-3, weight_decay=0.1).init(_params())
    new = optim.set_hyperparams(state, weight_decay=torch.tensor(0.2, dtype=torch.float64))
    assert float(optim.hyperparams(state)["weight_decay"]) == pytest.approx(0.1)
    assert float(optim.hyperparams(new)["weight_decay"]) == pytest.approx(0.2)
    assert optim.hyperparams(new)["weight_decay"].dtype == torch.float32
    assert new[0] is state[0]  # untouched parts are shared, not copied


def test_scheduled_lr_is_logged_and_scaled_not_set() -> None:
    schedule = optim.linear_schedule(1.0, 0.0, 10)
    tx = optim.sgd(schedule)
    params = _params()
    state = tx.init(params)
    assert float(optim.hyperparams(state)["learning_rate"]) == pytest.approx(1.0)
    grads = {"w": torch.ones(3), "b": torch.ones(1)}
    _, state = tx.update(grads, state)  # used schedule(0)
    _, state = tx.update(grads, state)  # used schedule(1)
    assert float(optim.hyperparams(state)["learning_rate"]) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="learning_rate_scale"):
        optim.set_hyperparams(state, learning_rate=0.1)
    state = optim.set_hyperparams(state, learning_rate_scale=0.5)
    updates, state = tx.update(grads, state)  # schedule(2) * 0.5
    assert torch.allclose(updates["w"], torch.full((3,), -0.4))
    assert float(optim.hyperparams(state)["learning_rate"]) == pytest.approx(0.4)


def test_unknown_name_lists_the_known_ones() -> None:
    state = optim.adam(1e-3).init(_params())
    with pytest.raises(KeyError, match=r"'lr'.*\['learning_rate'\]"):
        optim.set_hyperparams(state, lr=0.1)


def test_multi_transform_names_are_qualified_by_label() -> None:
    params = _params()
    tx = optim.multi_transform(
        {"body": optim.adamw(1e-3), "bias": optim.sgd(0.1)}, {"w": "body", "b": "bias"}
    )
    state = tx.init(params)
    names = optim.hyperparams(state)
    assert set(names) == {"body/learning_rate", "bias/learning_rate", "weight_decay"}
    with pytest.raises(KeyError, match="ambiguous"):
        optim.set_hyperparams(state, learning_rate=0.1)
    state = optim.set_hyperparams(state, **{"bias/learning_rate": 0.5})
    updates, _ = tx.update({"w": torch.zeros(3), "b": torch.ones(1)}, state, params)
    assert torch.allclose(updates["b"], torch.tensor([-0.5]))
    assert float(optim.hyperparams(state)["body/learning_rate"]) == pytest.approx(1e-3)


def test_hyperparams_found_inside_wrappers() -> None:
    tx = optim.skip_not_finite(
        optim.chain(optim.clip_by_global_norm(1.0), optim.freeze(optim.lion(1e-4), {"w": False, "b": True}))
    )
    names = optim.hyperparams(tx.init(_params()))
    assert set(names) == {"learning_rate", "weight_decay"}


def test_bad_value_is_rejected() -> None:
    state = optim.sgd(0.1).init(_params())
    with pytest.raises(ValueError, match="scalar"):
        optim.set_hyperparams(state, learning_rate=torch.ones(2))
    with pytest.raises(TypeError, match="learning_rate"):
        optim.set_hyperparams(state, learning_rate="0.1")  # type: ignore[arg-type]
