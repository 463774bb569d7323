"""Differentiating through training: ``torch.func.grad`` of a validation loss after K unrolled train steps,
w.r.t. the initial params and the hyperparameters in the optimizer state, for every optimizer, against
central finite differences in float64; eagerly, and compiled as one inductor graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import functrain as ft
from functrain import optim
from functrain.core import foreach
from functrain.step import make_train_step

STEPS = 3
TOLERANCE = 1e-6  # relative, against central differences (which are good to ~1e-9 here)

OPTIMIZERS: dict[str, Callable[[], optim.GradientTransformation]] = {
    "sgd": lambda: optim.sgd(0.1),
    "momentum": lambda: optim.sgd(0.1, momentum=0.9),
    "nesterov_l2": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: optim.adam(0.05),
    "adam_l2_amsgrad": lambda: optim.adam(0.05, weight_decay=0.1, amsgrad=True),
    "adamw": lambda: optim.adamw(0.05, weight_decay=0.1),
    "adamw_unfused": lambda: optim.adamw(0.05, weight_decay=0.1, fused=False),
    "adamw_masked_clipped": lambda: optim.chain(
        optim.clip_by_global_norm(0.5),
        optim.adamw(0.05, weight_decay=0.1, mask=lambda p: optim.mask_by_name(p, "*.weight")),
    ),
    "adamw_scheduled": lambda: optim.adamw(optim.cosine_decay_schedule(0.05, 10), weight_decay=0.1),
    "lion": lambda: optim.lion(0.01, weight_decay=0.1),
    "lamb": lambda: optim.lamb(0.05, weight_decay=0.1),
    "adagrad": lambda: optim.adagrad(0.1, lr_decay=0.1),
    "rmsprop": lambda: optim.rmsprop(0.01, momentum=0.5),
    "rmsprop_centered_l2": lambda: optim.rmsprop(0.001, centered=True, weight_decay=0.01),
    "clip_sgd": lambda: optim.chain(optim.clip(0.05), optim.sgd(0.1)),
    "multi_transform": lambda: optim.multi_transform(
        {"body": optim.sgd(0.1, momentum=0.9), "head": optim.adamw(0.05, weight_decay=0.1)},
        lambda p: optim.labels_by_name(p, {"2.*": "head"}, default="body"),
    ),
    "skip_not_finite": lambda: optim.skip_not_finite(optim.lamb(0.05, weight_decay=0.1)),
}


class Unrolled:
    """A tiny float64 MLP trained ``STEPS`` steps by ``make_train_step``; ``loss(params, hyper)`` is the
    validation loss after them, from the given initial params and hyperparameters."""

    def __init__(self, tx: optim.GradientTransformation) -> None:
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
        ).double()
        self.state = ft.TrainState.create(self.model, tx, dtype=torch.float64)
        self.step = make_train_step(self.model, lambda m, b: F.mse_loss(m(b[0]), b[1]))
        self.batches = [
            (
                torch.randn(8, 3, generator=g, dtype=torch.float64),
                torch.randn(8, 1, generator=g, dtype=torch.float64),
            )
            for _ in range(STEPS)
        ]
        self.val = (
            torch.randn(16, 3, generator=g, dtype=torch.float64),
            torch.randn(16, 1, generator=g, dtype=torch.float64),
        )
        self.params = {k: v.clone() for k, v in self.state.params.items()}
        hyper = optim.hyperparams(self.state.opt_state)
        if "learning_rate_scale" in hyper:  # a scheduled rate is read-only: its scale is what is set
            del hyper["learning_rate"]
        self.hyper = {k: v.clone() for k, v in hyper.items()}
        self.direction = {
            k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in self.params.items()
        }

    def loss(self, params: dict[str, torch.Tensor], hyper: dict[str, torch.Tensor]) -> torch.Tensor:
        state = self.state.replace(
            params=params, opt_state=optim.set_hyperparams(self.state.opt_state, **hyper)
        )
        for batch in self.batches:
            state, _ = self.step(state, batch)
        x, y = self.val
        return F.mse_loss(torch.func.functional_call(self.model, state.params, (x,)), y)

    def central(self, shift: Callable[[float], tuple[dict, dict]], eps: float = 1e-6) -> float:
        with torch.no_grad():
            return float((self.loss(*shift(eps)) - self.loss(*shift(-eps))) / (2 * eps))

    def check(self, grads: tuple[dict[str, torch.Tensor], ...], argnums: tuple[int, ...] = (0, 1)) -> None:
        """Every derivative asked for against central differences: the params' along a random direction,
        each hyperparameter's alone."""
        by_arg = dict(zip(argnums, grads))
        if 0 in by_arg:
            along = self.central(
                lambda e: ({k: v + e * self.direction[k] for k, v in self.params.items()}, self.hyper)
            )
            got = float(sum((by_arg[0][k] * self.direction[k]).sum() for k in self.params))
            assert abs(got - along) <= TOLERANCE * abs(along), ("params", got, along)
        if 1 in by_arg:
            assert set(by_arg[1]) == set(self.hyper)
            for name, value in self.hyper.items():
                expected = self.central(lambda e, n=name, v=value: (self.params, {**self.hyper, n: v + e}))
                got = float(by_arg[1][name])
                assert expected != 0.0 and abs(got - expected) <= TOLERANCE * abs(expected), (
                    name,
                    got,
                    expected,
                )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_through_unrolled_steps_matches_finite_differences(name: str) -> None:
    run = Unrolled(OPTIMIZERS[name]())
    run.check(torch.func.grad(run.loss, argnums=(0, 1))(run.params, run.hyper))


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_grad_wrt_hyperparameters_alone_matches_finite_differences(name: str) -> None:
    """Only the hyperparameters are differentiated: the first step's params, grads and moments are plain
    tensors, and the fused Adam kernel (no backward) must still not run on a differentiated rate."""
    run = Unrolled(OPTIMIZERS[name]())
    run.check((torch.func.grad(run.loss, argnums=1)(run.params, run.hyper),), argnums=(1,))


def test_plain_autograd_through_params_that_require_grad() -> None:
    """``torch.autograd.grad`` (not functorch) through the unrolled steps: params and rate that require
    gradients take the differentiable path too."""
    run = Unrolled(optim.adamw(0.05, weight_decay=0.1))
    params = {k: v.clone().requires_grad_() for k, v in run.params.items()}
    hyper = {k: v.clone().requires_grad_() for k, v in run.hyper.items()}
    leaves = [*params.values(), *hyper.values()]
    grads = torch.autograd.grad(run.loss(params, hyper), leaves)
    run.check((dict(zip(params, grads[: len(params)])), dict(zip(hyper, grads[len(params) :]))))


def test_set_hyperparams_keeps_the_value_differentiable() -> None:
    state = optim.sgd(0.1).init({"w": torch.zeros(2)})
    rate = torch.tensor(0.3, requires_grad=True)
    value = optim.hyperparams(optim.set_hyperparams(state, learning_rate=rate))["learning_rate"]
    (grad,) = torch.autograd.grad(value * 2, rate)
    assert float(grad) == 2.0


def _profiled_ops(fn: Callable[[], Any]) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_foreach_kernels_stay_where_nothing_is_differentiated() -> None:
    """The fast path: one foreach kernel for plain tensors; leaf by leaf (and differentiable) for tensors
    that require gradients, where ``_foreach_mul(list, 0-d tensor)`` has no working backward."""
    leaves = [torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
    rate = torch.tensor(0.5, dtype=torch.float64)
    assert "aten::_foreach_mul" in _profiled_ops(lambda: foreach.mul(leaves, rate))
    rate.requires_grad_()
    assert "aten::_foreach_mul" not in _profiled_ops(lambda: foreach.mul(leaves, rate))
    out = foreach.mul(leaves, rate)
    foreach.add_(out, leaves)  # in place: the list's items are replaced, autograd's saved tensors kept
    (grad,) = torch.autograd.grad(sum(x.sum() for x in out), rate)
    assert float(grad) == 5.0
    with torch.no_grad():  # nothing is recorded: the kernel again
        assert "aten::_foreach_mul" in _profiled_ops(lambda: foreach.mul(leaves, rate))


def test_in_place_op_on_a_tuple_that_is_differentiated_names_the_fix() -> None:
    rate = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(
        TypeError, match="add_: differentiating through an in-place op needs its first argument"
    ):
        foreach.add_((torch.ones(2),), [rate * torch.ones(2)])


@pytest.mark.compile
@pytest.mark.parametrize("name", ["momentum", "adamw", "lamb"])
def test_compiled_grad_through_unrolled_steps_is_one_graph_and_matches(name: str, recording_inductor) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    run = Unrolled(OPTIMIZERS[name]())
    compiled = torch.compile(
        torch.func.grad(run.loss, argnums=(0, 1)), fullgraph=True, backend=recording_inductor
    )
    run.check(compiled(run.params, run.hyper))
    assert len(recording_inductor.graphs) == 1
