"""The gradient inside a compiled step (:func:`functrain.step.grad.loss_and_grad` while dynamo traces):
``torch.func.grad_and_value``'s results, bitwise, with a trace whose length does not grow by torch's
Python pytree walk per param (issue 33, warm start)."""

from __future__ import annotations

import torch
import torch._dynamo
from dynamo_instructions import instructions_traced
from torch import nn

from functrain.step.grad import loss_and_grad


def _net() -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    params["unused"] = torch.randn(2)  # no path to the loss: a zero gradient
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return model, params, buffers


def _loss(model: nn.Module):
    def loss(params: dict, buffers: dict, x: torch.Tensor, factor: torch.Tensor) -> tuple:
        buffers = {k: v.clone() for k, v in buffers.items()}  # BatchNorm writes its running stats here
        used = {k: v for k, v in params.items() if k != "unused"}
        out = torch.func.functional_call(model, {**used, **buffers}, (x,))
        value = out.square().mean()
        return value * factor, (value.detach(), {"max": out.max().detach()}, buffers)

    return loss


def _equal(a, b) -> bool:
    flat_a, spec_a = torch.utils._pytree.tree_flatten(a)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(b)
    return spec_a == spec_b and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def test_the_traced_gradient_is_the_transforms_bitwise() -> None:
    model, params, buffers = _net()
    loss = _loss(model)
    x, factor = torch.randn(8, 4), torch.tensor(0.5)
    expected = torch.func.grad_and_value(loss, has_aux=True)(params, buffers, x, factor)
    torch._dynamo.reset()
    traced = torch.compile(loss_and_grad(loss), backend="eager", fullgraph=True)(params, buffers, x, factor)
    assert _equal(traced, expected)
    grads, (_, (_, _, new_buffers)) = traced
    assert torch.equal(grads["unused"], torch.zeros(2))
    assert not torch.equal(new_buffers["1.running_mean"], buffers["1.running_mean"])  # the stats moved
    assert not any(g.requires_grad for g in grads.values())


def test_the_traced_gradient_composes_with_vmap_and_an_outer_grad() -> None:
    torch.manual_seed(0)

    def loss(params: dict, x: torch.Tensor) -> tuple:
        value = torch.tanh(x @ params["w"] + params["b"]).pow(2).sum()
        return value, value.detach()

    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    members = {k: torch.stack([v, v * 0.5 + 1]) for k, v in params.items()}
    x = torch.randn(5, 3)

    def ensemble(grad_fn):
        return torch.func.vmap(lambda p: grad_fn(p, x))(members)

    def second_order(grad_fn):  # the gradient of a function of the gradient
        return torch.func.grad(lambda p: grad_fn(p, x)[0]["w"].square().sum())(params)

    transform = torch.func.grad_and_value(loss, has_aux=True)
    for composed in (ensemble, second_order):
        torch._dynamo.reset()
        traced = torch.compile(composed, backend="eager", fullgraph=True)(loss_and_grad(loss))
        assert _equal(traced, composed(transform)), composed.__name__


def _instructions_traced(n_params: int) -> int:
    """Bytecode instructions dynamo interprets to trace ``loss_and_grad`` over ``n_params`` params."""
    params = {f"p{i}": torch.randn(3) for i in range(n_params)}
    x = torch.randn(3)

    def loss(params: dict, x: torch.Tensor) -> tuple:
        value = torch.stack([(p * x).sum() for p in params.values()]).sum()
        return value, value.detach()

    return instructions_traced(loss_and_grad(loss), params, x)


def test_the_trace_grows_by_few_instructions_per_param() -> None:
    # The loss's own trace costs ~15 instructions per param. torch.func.grad_and_value's Python pytree
    # (flatten, unflatten and tree_map of the params, several times) cost ~240 more per param
    # (7.5k of a 2-layer GPT step's 24k); functrain's traced gradient walks the params in plain loops.
    per_param = (_instructions_traced(40) - _instructions_traced(8)) / 32
    assert per_param < 100, per_param
