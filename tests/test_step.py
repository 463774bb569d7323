"""Train/eval steps: purity, BatchNorm threading, accumulation, mixed precision, errors (eager)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models import SmallCNN, TiedLM, classification_batch, mlp
from torch import nn

import functrain as ft
from functrain import tree


def _snapshot(state):
    return [x.clone() for x in tree.leaves(state) if isinstance(x, torch.Tensor)]


def _bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        if x.numel()
        else x.shape == y.shape
        for x, y in zip(a, b)
    )


def test_step_is_pure_and_deterministic():
    torch.manual_seed(0)
    model = mlp(dropout=0.3)
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2), seed=3)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)), compile=False)
    batch = classification_batch()
    before = _snapshot(state)
    s1, m1 = step(state, batch)
    assert _bitwise_equal(before, _snapshot(state)), "the input state was modified"
    s2, m2 = step(state, batch)
    assert _bitwise_equal(_snapshot(s1), _snapshot(s2))
    assert torch.equal(m1["loss"], m2["loss"])
    assert int(s1.step) == 1 and int(state.step) == 0
    assert not _bitwise_equal(before, _snapshot(s1)), "the step changed nothing"


def test_a_step_is_a_frozen_value_whose_fields_jit_reads():
    model = mlp()
    step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    assert step.kind == "train" and step.model is model and step.settle is not None and step.masked_batches
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.masked_batches = False  # nothing is patched onto a step: a changed step is a new value
    unpadded = step.replace(masked_batches=False)
    assert step.masked_batches and not unpadded.masked_batches and unpadded.fn is step.fn
    compiled = ft.jit(unpadded, compile=False)
    assert compiled.step is unpadded and ft.step.as_step(compiled) is unpadded
    assert not hasattr(compiled, "metrics") and not hasattr(step.fn, "spec")  # no aliases, no attributes
    assert ft.step.as_step(step.fn).kind == "custom"  # a plain function
    state, batch = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0), classification_batch()
    new, metrics = compiled(state, batch)
    reference, ref_metrics = step(state, batch)
    assert torch.equal(metrics["loss"], ref_metrics["loss"])
    assert all(torch.equal(new.params[k], reference.params[k]) for k in reference.params)


def test_step_seed_depends_on_step_and_key():
    model = mlp(dropout=0.5)
    loss_fn = ft.supervised_loss(F.cross_entropy)
    step = ft.jit(ft.make_train_step(model, loss_fn), compile=False)
    batch = classification_batch()
    a = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    b = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=1)
    la = step(a, batch)[1]["loss"]
    lb = step(b, batch)[1]["loss"]
    la2 = step(a.replace(step=torch.tensor(5)), batch)[1]["loss"]
    assert not torch.equal(la, lb) and not torch.equal(la, la2)


def test_batchnorm_buffers_threaded_and_eval_mode():
    torch.manual_seed(0)
    model = SmallCNN(dropout=0.0)
    state = ft.TrainState.create(model, ft.optim.sgd(0.0))  # lr 0: only buffers change
    loss_fn = ft.supervised_loss(F.cross_entropy)
    x = torch.randn(8, 1, 8, 8) * 3 + 1
    y = torch.randint(0, 4, (8,))
    new, _ = ft.make_train_step(model, loss_fn)(state, (x, y))
    # Reference: the module itself in train mode updates running stats the same way.
    ref = SmallCNN(dropout=0.0)
    ref.load_state_dict(state.state_dict())
    ref.train()
    ref(x)
    torch.testing.assert_close(new.buffers["features.1.running_mean"], ref.features[1].running_mean)
    torch.testing.assert_close(new.buffers["features.1.running_var"], ref.features[1].running_var)
    assert int(new.buffers["features.1.num_batches_tracked"]) == 1
    # Eval: no statistics update, same output as the module in eval mode.
    out = ft.make_eval_step(model, loss_fn, return_preds=True)(new, (x, y))
    ref.eval()
    torch.testing.assert_close(out["preds"], ref(x))
    torch.testing.assert_close(out["loss"], F.cross_entropy(ref(x), y))


def test_accumulation_equals_large_batch():
    torch.manual_seed(0)
    model = mlp()
    loss_fn = ft.supervised_loss(F.cross_entropy)
    state = ft.TrainState.create(model, ft.optim.sgd(0.5)).to(dtype=torch.float64)
    x, y = classification_batch(n=22)  # 22 = 6 + 6 + 5 + 5: unequal micro-batches
    batch = (x.double(), y)
    big, m_big = ft.make_train_step(model, loss_fn)(state, batch)
    acc, m_acc = ft.make_train_step(model, loss_fn, accumulate=4)(state, batch)
    for k in big.params:
        torch.testing.assert_close(acc.params[k], big.params[k], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(m_acc["loss"], m_big["loss"], rtol=1e-6, atol=0)


def test_aux_metrics_reported():
    model = mlp()

    def loss_fn(call, batch):
        x, y = batch
        logits = call(x)
        acc = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits, y), {"metrics": {"acc": acc}}

    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    _, m = ft.make_train_step(model, loss_fn)(state, classification_batch())
    assert set(m) == {"loss", "grad_norm", "acc"} and 0 <= float(m["acc"]) <= 1


def test_apply_function_instead_of_module():
    w = torch.randn(3, 2)

    def apply(params, buffers, x):
        return x @ params["w"]

    tx = ft.optim.sgd(0.1)
    state = ft.TrainState(
        step=torch.zeros((), dtype=torch.int64),
        params={"w": w},
        buffers={},
        opt_state=tx.init({"w": w}),
        rng=ft.random.key(0),
        tx=tx,
    )
    x = torch.randn(5, 3)
    step = ft.make_train_step(apply, lambda call, b: call(b).pow(2).mean())
    new, _ = step(state, x)
    expected = w - 0.1 * torch.func.grad(lambda w_: (x @ w_).pow(2).mean())(w)
    torch.testing.assert_close(new.params["w"], expected)


def test_fp16_overflow_skips_update_and_halves_scale():
    model = mlp()
    scale = ft.precision.LossScale.create(init_scale=2.0**8, growth_interval=2)
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), loss_scale=scale)
    inject = {"on": True}

    def loss_fn(call, batch):
        x, y = batch
        loss = F.cross_entropy(call(x).float(), y)
        return loss * torch.tensor(float("inf")) if inject["on"] else loss

    step = ft.make_train_step(model, loss_fn, precision="fp16")
    s1, _ = step(state, classification_batch())
    assert float(s1.loss_scale.scale) == 2.0**7 and int(s1.loss_scale.skipped) == 1
    for k in state.params:
        assert torch.equal(s1.params[k], state.params[k])
    assert _bitwise_equal(_snapshot(s1.opt_state), _snapshot(state.opt_state))
    inject["on"] = False
    s2, _ = step(s1, classification_batch())
    s3, _ = step(s2, classification_batch())
    assert not torch.equal(s2.params["0.weight"], s1.params["0.weight"])
    assert float(s3.loss_scale.scale) == 2.0**8, "two finite steps (growth_interval=2) double the scale"


def test_fp16_without_loss_scale_is_an_error():
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="loss_scale"):
        ft.make_train_step(model, ft.supervised_loss(F.cross_entropy), precision="fp16")(
            state, classification_batch()
        )


def test_bf16_autocast_runs_on_cpu():
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    seen = {}

    def loss_fn(call, batch):
        x, y = batch
        logits = call(x)
        seen["dtype"] = logits.dtype
        return F.cross_entropy(logits, y)

    new, m = ft.make_train_step(model, loss_fn, precision="bf16")(state, classification_batch())
    assert seen["dtype"] == torch.bfloat16
    assert new.params["0.weight"].dtype == torch.float32 and torch.isfinite(m["loss"])


@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (lambda call, b: F.cross_entropy(call(b[0]), b[1], reduction="none"), "0-d tensor"),
        (lambda call, b: "not a tensor", "0-d tensor or"),
    ],
)
def test_bad_loss_is_explained(loss_fn, match):
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    with pytest.raises((ValueError, TypeError), match=match):
        ft.make_train_step(model, loss_fn)(state, classification_batch())


def test_state_from_another_model_is_explained():
    state = ft.TrainState.create(mlp(), ft.optim.sgd(0.1))
    other = SmallCNN()
    with pytest.raises(ValueError, match="does not belong to this model"):
        ft.make_train_step(other, ft.supervised_loss(F.cross_entropy))(state, classification_batch())


def test_supervised_batch_errors_name_the_fix():
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))
    with pytest.raises(KeyError, match="input key"):
        step(state, {"features_wrong": torch.randn(4, 8), "label": torch.zeros(4, dtype=torch.long)})


def test_predict_step():
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    x = torch.randn(4, 8)
    out = ft.make_predict_step(model)(state, (x, None))
    model.eval()
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_tied_weights_get_both_uses_gradient_as_in_torch(compiled):
    torch.manual_seed(0)
    model = TiedLM(vocab=7)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss = ft.supervised_loss(lambda logits, y: F.cross_entropy(logits.reshape(-1, 7), y.reshape(-1)))
    state = ft.TrainState.create(model, ft.optim.sgd(0.5))
    assert set(state.params) == {"embed.weight"}
    step = ft.jit(ft.make_train_step(model, loss), compile=compiled)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randint(0, 7, (5, 3), generator=g), torch.randint(0, 7, (5, 3), generator=g)
        state, _ = step(state, (x, y))
        opt.zero_grad()
        F.cross_entropy(reference(x).reshape(-1, 7), y.reshape(-1)).backward()
        opt.step()
    torch.testing.assert_close(state.params["embed.weight"], reference.embed.weight, rtol=1e-5, atol=1e-6)
    out = ft.make_predict_step(model)(state, x)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)


class _CountsTrain(nn.Module):
    """A module with its own ``train()``: the step must call it, not only write ``training`` flags."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(3, 2), nn.Dropout(0.5)
        self.modes: list[bool] = []

    def train(self, mode: bool = True) -> _CountsTrain:
        self.modes.append(mode)
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


def _mode_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    return model, (x, y), ft.supervised_loss(F.cross_entropy)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_steps_set_every_modules_mode_and_freeze_batchnorm(compiled):
    model, batch, loss = _mode_case()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    train = ft.jit(ft.make_train_step(model, loss, freeze_batchnorm=True), compile=compiled)
    evaluate = ft.jit(ft.make_eval_step(model, loss), compile=compiled)
    model.eval()
    new, _ = train(state, batch)
    assert [m.training for m in model.modules()] == [True, True, False, True, True]
    # Frozen BatchNorm: its running statistics are not updated by the train step.
    torch.testing.assert_close(new.buffers["1.running_mean"], state.buffers["1.running_mean"])
    evaluate(new, batch)
    assert not any(m.training for m in model.modules())
    unfrozen = ft.make_train_step(model, loss)
    assert not torch.equal(
        unfrozen(state, batch)[0].buffers["1.running_mean"], state.buffers["1.running_mean"]
    )
    assert all(m.training for m in model.modules())


class _CountsSetattr(nn.Module):
    """A module with its own ``__setattr__`` (as scripted modules have): the step must go through it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.modes: list[bool] = []

    def __setattr__(self, name: str, value: object) -> None:
        if name == "training" and "modes" in self.__dict__:
            self.modes.append(value)
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("model_type", [_CountsTrain, _CountsSetattr])
def test_a_modules_own_train_or_setattr_is_called_by_the_steps(model_type):
    model = model_type()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    loss = ft.supervised_loss(F.mse_loss)
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    ft.make_train_step(model, loss)(state, batch)
    ft.make_eval_step(model, loss)(state, batch)
    assert model.modes == [True, False]


def test_the_module_keeps_its_own_tensors_after_a_step_even_one_that_raises():
    model, batch, loss = _mode_case()
    before = {name: (t, t.clone()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    ft.make_train_step(model, loss)(state, batch)

    def bad_loss(model_fn, b):
        model_fn(b[0])
        raise RuntimeError("loss failed")

    with pytest.raises(RuntimeError, match="loss failed"):
        ft.make_train_step(model, bad_loss)(state, batch)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t is before[name][0], name
        assert torch.equal(t, before[name][1]), name


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


def test_a_parametrized_module_trains_as_with_torch_func_functional_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Symmetric())
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    assert "0.parametrizations.weight.original" in state.params
    _, metrics = ft.make_train_step(model, ft.supervised_loss(F.mse_loss))(state, (x, y))

    def reference(params):
        return F.mse_loss(torch.func.functional_call(model, {**params, **state.buffers}, (x,)), y)

    loss, grads = torch.func.grad_and_value(reference)(dict(state.params))[::-1]
    torch.testing.assert_close(metrics["loss"], loss)
    torch.testing.assert_close(
        metrics["grad_norm"], torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))
    )
