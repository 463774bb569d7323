"""TrainState: creation from modules (tied weights, frozen params, buffers), moving, export, pytrees."""

from __future__ import annotations

import torch
import torch.utils._pytree as torch_pytree
from models import SmallCNN, TiedLM, mlp
from torch import nn

import functrain as ft
from functrain import tree


def test_create_copies_weights_and_starts_at_step_zero():
    model = SmallCNN()
    state = ft.TrainState.create(model, ft.optim.adam(1e-3), seed=7)
    assert int(state.step) == 0 and state.step.dtype == torch.int64 and state.step.device.type == "cpu"
    for name, p in model.named_parameters():
        assert torch.equal(state.params[name], p) and state.params[name] is not p
    assert "features.1.running_mean" in state.buffers
    assert state.num_params == sum(p.numel() for p in model.parameters())
    assert torch.equal(state.rng, ft.random.key(7))


def test_create_without_copy_shares_memory_and_a_donating_step_trains_the_module():
    import torch.nn.functional as F

    model = SmallCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shared = ft.TrainState.create(model, ft.optim.adam(1e-2), copy=False)
    for name, p in model.named_parameters():
        assert shared.params[name].data_ptr() == p.data_ptr()
    assert shared.buffers["features.1.running_mean"].data_ptr() == model.features[1].running_mean.data_ptr()
    step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    batch = (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    expected, _ = ft.jit(step, compile=False)(shared, batch)
    for k, v in model.state_dict().items():  # a pure step never writes into the shared tensors
        assert torch.equal(v, before[k]), k
    out, _ = ft.jit(step, compile=False, donate=True)(shared, batch)
    trained = model.state_dict()
    for name in expected.params:
        assert torch.equal(out.params[name], expected.params[name])
        assert torch.equal(trained[name], expected.params[name]), (
            f"{name}: the module was not trained in place"
        )
    assert not torch.equal(trained["features.1.running_mean"], before["features.1.running_mean"])


def test_tied_weights_stay_tied_and_export_loads():
    model = TiedLM()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    assert list(state.params) == ["embed.weight"]
    assert ("out.weight", "embed.weight") in state.tied
    sd = state.state_dict()
    assert "cache" not in sd and "out.weight" in sd
    fresh = TiedLM()
    fresh.load_state_dict(sd, strict=True)
    assert fresh.out.weight is fresh.embed.weight
    # a step through the tied model updates the one shared tensor
    step = ft.make_train_step(model, lambda call, tok: call(tok).logsumexp(-1).mean())
    new, _ = step(state, torch.tensor([[1, 2, 3]]))
    assert not torch.equal(new.params["embed.weight"], state.params["embed.weight"])


def test_frozen_parameters_are_not_trained():
    model = mlp()
    model[0].weight.requires_grad_(False)
    state = ft.TrainState.create(model, ft.optim.sgd(1.0))
    assert "0.weight" not in state.params and "0.weight" in state.buffers
    step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy))
    new, _ = step(state, (torch.randn(4, 8), torch.zeros(4, dtype=torch.long)))
    assert torch.equal(new.buffers["0.weight"], state.buffers["0.weight"])
    assert not torch.equal(new.params["0.bias"], state.params["0.bias"])
    model.load_state_dict(new.state_dict())


def test_state_is_a_pytree_for_both_registries():
    state = ft.TrainState.create(mlp(), ft.optim.adam(1e-3))
    ours = tree.leaves(state)
    # torch's pytree counts None as a leaf, optree as an empty node: compare the tensors
    theirs = [x for x in torch_pytree.tree_leaves(state) if x is not None]
    assert len(ours) == len(theirs) > 0
    assert {id(x) for x in ours} == {id(x) for x in theirs}
    rebuilt = tree.unflatten(tree.structure(state), ours)
    assert isinstance(rebuilt, ft.TrainState) and rebuilt.tx is state.tx


def test_to_dtype_keeps_step_and_rng_on_cpu():
    state = ft.TrainState.create(mlp(), ft.optim.adam(1e-3)).to(dtype=torch.float64)
    assert all(v.dtype == torch.float64 for v in state.params.values())
    assert state.step.dtype == torch.int64 and state.rng.dtype == torch.int64


def test_repr_is_readable():
    text = repr(ft.TrainState.create(mlp(), ft.optim.adam(1e-3)))
    assert "step=0" in text and "params=" in text and "float32" in text and "cpu" in text


def test_apply_gradients_matches_manual_sgd():
    state = ft.TrainState.create(mlp(), ft.optim.sgd(0.5))
    grads = tree.map(torch.ones_like, state.params)
    new = state.apply_gradients(grads)
    for k in state.params:
        torch.testing.assert_close(new.params[k], state.params[k] - 0.5)
    assert int(new.step) == 1


def test_create_on_a_device_puts_the_loss_scale_and_metric_states_there_too():
    metrics = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    state = ft.TrainState.create(
        mlp(), ft.optim.sgd(0.1), device="meta", loss_scale=ft.precision.LossScale.create(),
        metrics=metrics.empty("cpu"),
    )  # fmt: skip
    moved = [state.loss_scale, state.metrics]
    assert {x.device.type for x in tree.leaves(moved) if isinstance(x, torch.Tensor)} == {"meta"}
    assert state.step.device.type == "cpu" and state.rng.device.type == "cpu"
