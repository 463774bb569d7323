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


def with_transposed_weights(train_step):
    """A step whose new params come back in the transposed strides of a 2-D weight (a layout drift that
    a graph's outputs can have where its inputs are contiguous)."""

    def step(state, batch):
        state, metrics = train_step(state, batch)
        params = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in state.params.items()}
        return state.replace(params=params), metrics

    return step


@pytest.mark.compile
def test_a_contiguous_state_compiles_without_the_layout_copy_and_a_drift_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2))
    batch = (torch.randn(16, 4), torch.randint(0, 3, (16,)))
    before = strides(state)
    train_step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    plain = ft.jit(train_step)
    state_a, _ = plain(state, batch)
    assert plain._layouts_in_graph is False  # the per-leaf copy is not traced for a contiguous state
    assert strides(state_a) == before and plain.num_compiles == 1

    drifting = ft.jit(with_transposed_weights(train_step))
    reference = ft.jit(train_step, compile=False)
    got, expected = state, state
    for _ in range(3):
        got, _ = drifting(got, batch)
        expected, _ = reference(expected, batch)
        assert strides(got) == before  # restored eagerly after the first compile, kept in-graph after
    assert drifting._layouts_in_graph is True and drifting.num_compiles == 2
    for a, b in zip(torch_pytree.tree_leaves(got), torch_pytree.tree_leaves(expected)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b)
