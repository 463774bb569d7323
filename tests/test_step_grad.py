"""The loss's gradient on the cheap tier (functrain/step/grad.py): plain autograd where no transform needs
``torch.func``, bitwise what ``grad_and_value`` gives; the transform wherever something composes with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import SmallCNN, TinyTransformer, classification_batch, mlp

import functrain as ft
from functrain.step import grad as grad_module


def _under_transform() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def _recording_loss(seen: list[bool]) -> Any:
    def loss_fn(model: Any, batch: Any) -> Any:
        seen.append(_under_transform())
        x, y = batch
        preds = model(x)
        return F.cross_entropy(preds, y), {"preds": preds, "target": y}

    return loss_fn


CASES = {
    "cnn-batchnorm": (
        lambda dropout: SmallCNN(dropout=dropout),
        lambda g: (torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)),
    ),
    "transformer": (
        lambda dropout: TinyTransformer(dropout=dropout),
        lambda g: (torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)),
    ),
}


def _train(case: str, dropout: float, steps: int = 3) -> tuple[Any, list, list[bool]]:
    make_model, make_batch = CASES[case]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = make_model(dropout)
    seen: list[bool] = []
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2, weight_decay=0.01))
    step = ft.make_train_step(model, _recording_loss(seen))
    history = []
    for i in range(steps):
        batch = make_batch(g)
        torch.manual_seed(i)  # the same dropout masks on both paths
        state, metrics = step(state, batch)
        history.append(metrics)
    return state, history, seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_steps_take_plain_autograd_bitwise_as_torch_func(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_state, plain_history, seen = _train(case, dropout=0.0)
    # the reference: every call through torch.func.grad_and_value, as on main
    monkeypatch.setattr(grad_module, "plain_autograd_applies", lambda params: False)
    func_state, func_history, func_seen = _train(case, dropout=0.0)
    assert seen == [True, False, False, False]  # the first step runs the transform as a check, then plain
    assert func_seen == [True, True, True]
    for name in ("params", "buffers"):
        for key, value in getattr(func_state, name).items():
            assert torch.equal(getattr(plain_state, name)[key], value), f"{name}.{key}"
    for a, b in zip(plain_history, func_history):
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["grad_norm"], b["grad_norm"])
        assert a["loss"].grad_fn is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_with_dropout_the_gradient_is_the_eager_pytorch_loops(case: str) -> None:
    # every call draws what loss.backward() on the module draws: the first call's check under the
    # transform draws nothing of the run's (a resumed run's first step is the uninterrupted run's)
    make_model, make_batch = CASES[case]
    torch.manual_seed(0)
    model = make_model(0.3).train()
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    def loss_of(params: dict, batch: Any) -> Any:
        tensors = {**params, **{n: b.clone() for n, b in buffers.items()}}  # BatchNorm writes into these
        return F.cross_entropy(torch.func.functional_call(model, tensors, batch[0]), batch[1]), ()

    grad_fn = grad_module.loss_and_grad(loss_of)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        batch = make_batch(g)
        torch.manual_seed(i)
        grads, (value, _) = grad_fn(params, batch)
        torch.manual_seed(i)
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        assert torch.equal(value, loss.detach())
        for name, p in model.named_parameters():
            assert torch.equal(grads[name], p.grad), name


def test_the_plain_path_detaches_what_it_returns_and_zeros_unused_params() -> None:
    def fn(params: dict, x: torch.Tensor) -> Any:
        y = params["w"] * x
        return y.sum(), {"y": y}

    grad_fn = grad_module.loss_and_grad(fn)
    params = {"w": torch.ones(2), "unused": torch.ones(3)}
    x = torch.tensor([1.0, 2.0])
    first = grad_fn(params, x)
    second = grad_fn(params, x)
    for grads, (value, aux) in (first, second):
        assert grads["w"].tolist() == [1.0, 2.0] and grads["unused"].tolist() == [0.0, 0.0, 0.0]
        assert not value.requires_grad and not aux["y"].requires_grad
    assert not params["w"].requires_grad  # the caller's tensors are not touched
    constant = grad_module.loss_and_grad(lambda p: (torch.tensor(1.0), ()))
    for _ in range(2):
        assert constant({"w": torch.ones(2)})[0]["w"].tolist() == [0.0, 0.0]


def test_the_transform_runs_where_something_composes_with_it() -> None:
    # d/dw of sum(grad(f)) for f = sum(w^3): 6w, by torch.func.grad over the step's gradient, by an outer
    # autograd backward through it (params that require grad), and per member under vmap
    grad_fn = grad_module.loss_and_grad(lambda p: ((p["w"] ** 3).sum(), ()))
    w = torch.tensor([1.0, 2.0])
    grad_fn({"w": w})  # checked once: later calls would take plain autograd where it applies
    outer = torch.func.grad(lambda w: grad_fn({"w": w})[0]["w"].sum())(w)
    assert outer.tolist() == [6.0, 12.0]
    leaf = w.clone().requires_grad_()
    grad_fn({"w": leaf})[0]["w"].sum().backward()
    assert leaf.grad.tolist() == [6.0, 12.0]
    stacked = torch.stack([w, 2 * w])
    per_member = torch.vmap(lambda v: grad_fn({"w": v})[0]["w"])(stacked)
    assert per_member.tolist() == [[3.0, 12.0], [12.0, 48.0]]
    assert not grad_module.plain_autograd_applies({"w": leaf})
    assert grad_module.plain_autograd_applies({"w": w})


def test_an_ensemble_step_keeps_the_transform_and_trains_each_member_as_alone() -> None:
    x, y = classification_batch()
    models = [mlp() for _ in range(2)]
    loss_fn = ft.supervised_loss(F.cross_entropy)
    tx = ft.optim.adamw(1e-2)
    states = [ft.TrainState.create(m, tx) for m in models]
    alone = []
    for model, state in zip(models, states):
        step = ft.make_train_step(model, loss_fn)
        for _ in range(2):
            state, _ = step(state, (x, y))
        alone.append(state)
    ensemble = ft.ensemble.stack(states)
    step = ft.ensemble.step(ft.make_train_step(models[0], loss_fn))
    for _ in range(2):
        ensemble, _ = step(ensemble, (x, y))
    for i, state in enumerate(alone):
        for key, value in state.params.items():
            torch.testing.assert_close(ensemble.params[key][i], value, rtol=1e-6, atol=1e-7)
