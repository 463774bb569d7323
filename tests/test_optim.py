"""functrain.optim aliases against torch.optim (200 steps on an MLP) and float64 reference formulas."""

from __future__ import annotations

import math

import pytest
import torch

from functrain import optim, tree

STEPS = 200


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny tensors on 2 shared cores: intra-op threads only add contention (5x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def _max_relative_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Per leaf ``max|a - b| / max|b|``, the worst leaf (elementwise ratios blow up near zero)."""
    return max(float((ours[k] - reference[k]).abs().max() / reference[k].abs().max()) for k in reference)


def _forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The MLP of :func:`_mlp` as a function of its ``named_parameters()`` dict (faster than functional_call)."""
    h = torch.tanh(torch.nn.functional.linear(x, params["0.weight"], params["0.bias"]))
    h = torch.tanh(torch.nn.functional.linear(h, params["2.weight"], params["2.bias"]))
    return torch.nn.functional.linear(h, params["4.weight"], params["4.bias"])


def _run_parity(make_ours, make_reference, apply: bool = False) -> float:  # type: ignore[no-untyped-def]
    """Run both optimizers for STEPS steps from the same weights; the worst relative difference at the end.

    ``apply``: step with ``optim.apply_gradients`` (the fused path train steps take) instead of ``update``.

    Both receive the same gradient each step (the MLP's gradient at *our* parameters): the test compares
    optimizer arithmetic, and a 1-ulp difference cannot be amplified by the loss landscape into a
    different trajectory.
    """
    x, y = _data()
    reference_model = _mlp()
    initial = {k: v.detach().clone() for k, v in reference_model.named_parameters()}
    params = dict(initial)

    def grad_fn(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
        loss = torch.nn.functional.mse_loss(_forward(leaves, x), y)
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    tx = make_ours()
    state = tx.init(params)
    reference_opt = make_reference(reference_model.parameters())
    for _ in range(STEPS):
        grads = grad_fn(params)
        if apply:
            params, state = optim.apply_gradients(tx, grads, state, params)
        else:
            updates, state = tx.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        for k, v in reference_model.named_parameters():
            v.grad = grads[k].clone()
        reference_opt.step()
    reference = {k: v.detach() for k, v in reference_model.named_parameters()}
    moved = _max_relative_difference(params, initial)
    assert moved > 1e-3, "the optimizer barely moved the parameters: the comparison would prove nothing"
    return _max_relative_difference(params, reference)


PARITY_CASES = {
    "sgd": (lambda: optim.sgd(0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd_momentum": (
        lambda: optim.sgd(0.02, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
    ),
    "sgd_nesterov": (
        lambda: optim.sgd(0.02, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, nesterov=True),
    ),
    "sgd_weight_decay": (
        lambda: optim.sgd(0.02, momentum=0.5, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.5, weight_decay=0.1),
    ),
    "adam": (lambda: optim.adam(1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
    "adam_l2": (
        lambda: optim.adam(1e-3, b1=0.8, b2=0.99, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1),
    ),
    "adamw": (
        lambda: optim.adamw(1e-3, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    ),
    "amsgrad": (
        lambda: optim.adamw(1e-3, weight_decay=0.01, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, amsgrad=True),
    ),
    "rmsprop": (lambda: optim.rmsprop(1e-3), lambda p: torch.optim.RMSprop(p, lr=1e-3)),
    "rmsprop_momentum": (
        lambda: optim.rmsprop(1e-3, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, weight_decay=0.01),
    ),
    "rmsprop_centered": (
        lambda: optim.rmsprop(1e-3, centered=True, momentum=0.9),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True, momentum=0.9),
    ),
    "adagrad": (lambda: optim.adagrad(0.05), lambda p: torch.optim.Adagrad(p, lr=0.05)),
    "adagrad_decay": (
        lambda: optim.adagrad(0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
        lambda p: torch.optim.Adagrad(
            p, lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1
        ),
    ),
}


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_alias_matches_torch_optim_over_200_steps(name: str) -> None:
    make_ours, make_reference = PARITY_CASES[name]
    assert _run_parity(make_ours, make_reference) <= 1e-5


def _random_grads(shapes: dict[str, tuple[int, ...]], steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(steps)]


def test_lion_matches_float64_formula() -> None:
    shapes = {"w": (5, 3), "b": (3,)}
    params = {k: torch.randn(s, generator=torch.Generator().manual_seed(3)) for k, s in shapes.items()}
    lr, b1, b2, wd = 0.01, 0.9, 0.99, 0.1
    tx = optim.lion(lr, b1=b1, b2=b2, weight_decay=wd)
    state = tx.init(params)
    ref_p = {k: v.double() for k, v in params.items()}
    ref_m = {k: torch.zeros_like(v) for k, v in ref_p.items()}
    for grads in _random_grads(shapes, 5):
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for k, g in grads.items():
            g = g.double()
            direction = torch.sign(b1 * ref_m[k] + (1 - b1) * g)
            ref_p[k] = ref_p[k] - lr * (direction + wd * ref_p[k])
            ref_m[k] = b2 * ref_m[k] + (1 - b2) * g
    for k in shapes:
        torch.testing.assert_close(params[k].double(), ref_p[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[0].mu[k].double(), ref_m[k], rtol=1e-5, atol=1e-6)


def test_lamb_matches_float64_formula() -> None:
    shapes = {"w": (6, 4), "b": (4,)}
    params = {k: torch.randn(s, generator=torch.Generator().manual_seed(4)) for k, s in shapes.items()}
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.05
    tx = optim.lamb(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state = tx.init(params)
    ref_p = {k: v.double() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in ref_p.items()}
    v = {k: torch.zeros_like(x) for k, x in ref_p.items()}
    for t, grads in enumerate(_random_grads(shapes, 5), start=1):
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for k, g in grads.items():
            g = g.double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            u = (m[k] / (1 - b1**t)) / (torch.sqrt(v[k] / (1 - b2**t)) + eps) + wd * ref_p[k]
            ratio = torch.linalg.vector_norm(ref_p[k]) / torch.linalg.vector_norm(u)
            ref_p[k] = ref_p[k] - lr * ratio * u
    for k in shapes:
        torch.testing.assert_close(params[k].double(), ref_p[k], rtol=1e-5, atol=1e-6)


ALL_TRANSFORMS = {
    "sgd_nesterov_wd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adam_amsgrad": lambda: optim.adam(0.1, amsgrad=True, weight_decay=0.1),
    "adamw_masked_schedule": lambda: optim.adamw(
        optim.cosine_decay_schedule(0.1, 10), mask=lambda p: optim.mask_by_name(p, "w")
    ),
    "rmsprop_centered": lambda: optim.rmsprop(0.1, centered=True, momentum=0.9, weight_decay=0.1),
    "adagrad": lambda: optim.adagrad(0.1, lr_decay=0.1, weight_decay=0.1),
    "lion": lambda: optim.lion(0.1),
    "lamb": lambda: optim.lamb(0.1, weight_decay=0.1),
    "clips": lambda: optim.chain(optim.clip(0.5), optim.clip_by_global_norm(1.0), optim.scale(-1.0)),
    "adam_eps_root": lambda: optim.chain(
        optim.scale_by_adam(eps_root=1e-8), optim.scale_by_learning_rate(0.1)
    ),
    "freeze_skip": lambda: optim.skip_not_finite(optim.freeze(optim.adamw(0.1), {"w": False, "b": True})),
    "multi": lambda: optim.multi_transform(
        {"x": optim.adam(0.1), "y": optim.sgd(0.1, momentum=0.9)}, {"w": "x", "b": "y"}
    ),
}


@pytest.mark.parametrize("name", list(ALL_TRANSFORMS))
def test_update_is_pure_inputs_stay_bit_identical(name: str) -> None:
    tx = ALL_TRANSFORMS[name]()
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    state = tx.init(params)
    for _ in range(2):  # the second update sees a non-trivial state
        grads = {"w": torch.randn(4, 3), "b": torch.randn(3)}
        before = tree.map(torch.clone, (params, grads, state))
        updates, new_state = tx.update(grads, state, params)
        for old, now in zip(tree.leaves(before), tree.leaves((params, grads, state))):
            assert torch.equal(old, now)
        params, state = optim.apply_updates(params, updates), new_state
    assert all(torch.isfinite(x).all() for x in tree.leaves(params))


def test_apply_updates_returns_new_tensors_in_param_dtype() -> None:
    params = {"a": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(1)}
    out = optim.apply_updates(params, {"a": torch.full((2,), 0.5), "b": torch.full((1,), -1.0)})
    assert out["a"].dtype == torch.bfloat16
    assert torch.equal(out["a"].float(), torch.full((2,), 1.5))
    assert torch.equal(out["b"], torch.zeros(1))
    assert torch.equal(params["b"], torch.ones(1))


def test_apply_updates_names_missing_leaf() -> None:
    with pytest.raises(ValueError, match="'b'"):
        optim.apply_updates({"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1)})


def test_update_with_grads_of_other_params_names_the_leaf() -> None:
    tx = optim.adam(0.1)
    state = tx.init({"a": torch.ones(1)})
    with pytest.raises(ValueError, match=r"scale_by_adam.*'extra'"):
        tx.update({"a": torch.ones(1), "extra": torch.ones(1)}, state)


def test_decoupled_decay_needs_params() -> None:
    tx = optim.adamw(0.1)
    with pytest.raises(ValueError, match="add_decayed_weights needs the current parameters"):
        tx.update({"a": torch.ones(1)}, tx.init({"a": torch.ones(1)}))


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="b2"):
        optim.adam(0.1, b2=1.0)
    with pytest.raises(TypeError, match="learning_rate"):
        optim.sgd("0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(TypeError, match="argument 1"):
        optim.chain(optim.scale(1.0), optim.scale_by_adam)  # type: ignore[arg-type]


def test_scalars_and_counts_are_0d_tensors() -> None:
    state = optim.adamw(optim.linear_schedule(0.1, 0.0, 10)).init({"w": torch.ones(2)})
    adam_state, _, lr_state = state
    assert adam_state.count.shape == () and adam_state.count.dtype == torch.int64
    assert lr_state.learning_rate.shape == () and lr_state.learning_rate.dtype == torch.float32
    _, state = optim.adamw(0.1).update(
        {"w": torch.ones(2)}, optim.adamw(0.1).init({"w": torch.ones(2)}), {"w": torch.ones(2)}
    )
    assert int(state[0].count) == 1
    assert math.isclose(float(state[2].learning_rate), 0.1, rel_tol=1e-7)
