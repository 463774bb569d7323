"""A pure step keeps the layouts of its state: channels_last stays channels_last, step after step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch import nn

import functrain as ft


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).to(memory_format=torch.channels_last)  # fmt: skip
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2))
    x = torch.randn(8, 3, 8, 8).to(memory_format=torch.channels_last)
    return model, state, (x, torch.randint(0, 4, (8,)))


def strides(state):
    return [t.stride() for t in torch_pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]


def with_contiguous_moments(train_step):
    """A step whose optimizer state leaves in another layout, as a graph's outputs can (issue 10)."""

    def step(state, batch):
        state, metrics = train_step(state, batch)
        moments = torch_pytree.tree_map(
            lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t, state.opt_state
        )
        return state.replace(opt_state=moments), metrics

    return step


def check_layouts_kept(compile):
    model, state, batch = setup()
    conv = state.params["0.weight"]
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    before = strides(state)
    train_step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    step = ft.jit(with_contiguous_moments(train_step), compile=compile)
    reference = ft.jit(train_step, compile=False)
    expected = state
    for _ in range(2):
        state, _ = step(state, batch)
        expected, _ = reference(expected, batch)
        assert strides(state) == before
    for a, b in zip(torch_pytree.tree_leaves(state), torch_pytree.tree_leaves(expected)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b)
    return step


def test_eager_pure_step_keeps_layouts():
    check_layouts_kept(compile=False)


@pytest.mark.compile
def test_compiled_pure_step_keeps_layouts_in_one_compile():
    step = check_layouts_kept(compile=True)
    assert step.num_compiles == 1  # a changed layout would also have recompiled


def test_eval_step_results_pass_through():
    model, state, batch = setup()
    out = ft.jit(ft.make_eval_step(model, ft.supervised_loss(F.cross_entropy)), compile=False)(state, batch)
    assert set(out) >= {"loss", "num_examples"}
