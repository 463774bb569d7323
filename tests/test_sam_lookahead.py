"""SAM (``make_train_step(..., sam_rho=)``) and lookahead (``ft.optim.lookahead``) against references
written from the papers in float64: Foret et al. 2021 (the gradient at ``w + rho * g / ||g||``, applied
at ``w``) and Zhang et al. 2019 (k fast steps, then the slow weights move toward the fast ones)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functrain as ft


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


def _batches(n: int = 4, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randn(rows, 4, dtype=torch.float64, generator=g), torch.randint(0, 3, (rows,), generator=g))
        for _ in range(n)
    ]


def _loss() -> ft.step.LossFn:
    return ft.supervised_loss(F.cross_entropy)


def _grad(model: torch.nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = F.cross_entropy(torch.func.functional_call(model, ps, (x,)), y)
    return dict(zip(ps, torch.autograd.grad(loss, list(ps.values()))))


def _sam_gradient(model: torch.nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor, rho: float) -> dict:
    """The paper's SAM gradient: g at w, then the gradient at w + rho * g / ||g||."""
    g = _grad(model, params, x, y)
    norm = torch.sqrt(sum((v**2).sum() for v in g.values()))
    return _grad(model, {k: params[k] + rho * g[k] / norm for k in params}, x, y)


def _adam(params: dict, grads: dict, st: dict, lr: float, t: int, b1=0.9, b2=0.999, eps=1e-8) -> dict:
    out = {}
    for k in params:
        st.setdefault(k, (torch.zeros_like(params[k]), torch.zeros_like(params[k])))
        m, v = st[k]
        m, v = b1 * m + (1 - b1) * grads[k], b2 * v + (1 - b2) * grads[k] ** 2
        st[k] = (m, v)
        out[k] = params[k] - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sam_matches_the_paper_in_float64(optimizer: str) -> None:
    model, rho, lr = _model(), 0.05, 0.1
    tx = ft.optim.sgd(lr) if optimizer == "sgd" else ft.optim.adam(lr)
    state = ft.TrainState.create(model, tx)
    step = ft.make_train_step(model, _loss(), sam_rho=rho)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    adam_state: dict = {}
    for t, (x, y) in enumerate(_batches(), start=1):
        state, metrics = step(state, (x, y))
        g = _sam_gradient(model, params, x, y, rho)
        plain_loss = F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
        assert float(metrics["loss"]) == pytest.approx(float(plain_loss), rel=1e-6)  # the loss at w
        if optimizer == "sgd":
            params = {k: params[k] - lr * g[k] for k in params}
        else:
            params = _adam(params, g, adam_state, lr, t)
    for k in params:
        torch.testing.assert_close(state.params[k], params[k], rtol=1e-12, atol=1e-13)
    # and it is not plain SGD/Adam: the perturbation changed the result
    plain = ft.TrainState.create(model, tx)
    for b in _batches():
        plain, _ = ft.make_train_step(model, _loss())(plain, b)
    assert float((plain.params["0.weight"] - state.params["0.weight"]).abs().max()) > 1e-6


def test_sam_with_accumulation_perturbs_each_micro_batch_by_its_own_gradient() -> None:
    model, rho, lr = _model(), 0.1, 0.5
    state = ft.TrainState.create(model, ft.optim.sgd(lr))
    ((x, y),) = _batches(1)
    state, _ = ft.make_train_step(model, _loss(), sam_rho=rho, accumulate=2)(state, (x, y))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    halves = [_sam_gradient(model, params, x[i : i + 4], y[i : i + 4], rho) for i in (0, 4)]
    for k in params:
        torch.testing.assert_close(
            state.params[k], params[k] - lr * (halves[0][k] + halves[1][k]) / 2, rtol=1e-12, atol=1e-13
        )


def test_sam_rho_is_checked() -> None:
    with pytest.raises(ValueError, match="sam_rho must be a positive float"):
        ft.make_train_step(_model(), _loss(), sam_rho=-1.0)


def _lookahead_reference(
    model: torch.nn.Module, batches: list, k: int, alpha: float, lr: float
) -> tuple[dict, dict]:
    """Zhang et al. 2019, Algorithm 1 with SGD inside: k fast steps from the slow weights, then
    slow += alpha * (fast - slow) and fast = slow."""
    slow = {n: v.detach().clone() for n, v in model.named_parameters()}
    fast = dict(slow)
    for t, (x, y) in enumerate(batches, start=1):
        g = _grad(model, fast, x, y)
        fast = {n: fast[n] - lr * g[n] for n in fast}
        if t % k == 0:
            slow = {n: slow[n] + alpha * (fast[n] - slow[n]) for n in slow}
            fast = dict(slow)
    return fast, slow


@pytest.mark.parametrize("k", [1, 3])
def test_lookahead_matches_the_paper_in_float64(k: int) -> None:
    model, alpha, lr = _model(), 0.5, 0.3
    batches = _batches(7)
    state = ft.TrainState.create(
        model, ft.optim.lookahead(ft.optim.sgd(lr), sync_period=k, slow_step_size=alpha)
    )
    step = ft.make_train_step(model, _loss())
    for b in batches:
        state, _ = step(state, b)
    fast, slow = _lookahead_reference(model, batches, k, alpha, lr)
    for n in fast:
        torch.testing.assert_close(state.params[n], fast[n], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(state.opt_state.slow[n], slow[n], rtol=1e-12, atol=1e-13)
    assert not torch.equal(
        state.params["0.weight"], ft.TrainState.create(model, ft.optim.sgd(lr)).params["0.weight"]
    )


def test_lookahead_reset_state_restarts_the_fast_optimizer_at_each_sync() -> None:
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    tx = ft.optim.lookahead(
        ft.optim.sgd(0.1, momentum=0.9), sync_period=2, slow_step_size=0.5, reset_state=True
    )
    state = tx.init(params)
    grads = {"w": torch.ones(2, dtype=torch.float64)}
    for expected_trace in (1.0, 0.0, 1.0, 0.0):  # reset after every second update
        updates, state = tx.update(grads, state, params)
        params = ft.optim.apply_updates(params, updates)
        trace = state.fast_state[0].trace["w"]
        assert float(trace[0]) == expected_trace


def test_lookahead_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="sync_period"):
        ft.optim.lookahead(ft.optim.sgd(0.1), sync_period=0, slow_step_size=0.5)
    with pytest.raises(ValueError, match="slow_step_size"):
        ft.optim.lookahead(ft.optim.sgd(0.1), sync_period=2, slow_step_size=1.5)


@pytest.mark.compile
def test_sam_with_lookahead_compiles_once_and_matches_eager() -> None:
    model = _model()
    tx = ft.optim.lookahead(ft.optim.adam(0.05), sync_period=2, slow_step_size=0.5)
    step = ft.make_train_step(model, _loss(), sam_rho=0.05)
    compiled = ft.jit(step)
    eager = jitted = ft.TrainState.create(model, tx)
    for b in _batches(4):
        eager, _ = step(eager, b)
        jitted, _ = compiled(jitted, b)
    assert compiled.num_compiles == 1, compiled.compile_reasons
    for k in eager.params:
        torch.testing.assert_close(jitted.params[k], eager.params[k], rtol=1e-10, atol=1e-12)
