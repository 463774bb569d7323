"""EMA / SWA of the params (functrain.optim.averaging) against torch.optim.swa_utils, in float64."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.optim import swa_utils

import functrain as ft
from functrain import optim
from functrain.optim import averaging


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(6, 4, generator=g, dtype=torch.float64),
            torch.randn(6, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(n)
    ]


def _train(tx: optim.GradientTransformation, steps: int, on_step=None):
    model = _mlp()
    state = ft.TrainState.create(model, tx)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss)), compile=False)
    for t, batch in enumerate(_batches(steps), start=1):
        state, _ = step(state, batch)
        if on_step is not None:
            on_step(t, state)
    return model, state


def _reference(avg_kwargs: dict, when=lambda t: True):
    """Feed the params our steps produce to AveragedModel, at the steps ``when`` says."""
    ref_model = _mlp()
    averaged = swa_utils.AveragedModel(ref_model, **avg_kwargs)

    def on_step(t, state):
        if when(t):
            ref_model.load_state_dict(state.state_dict())
            averaged.update_parameters(ref_model)

    return averaged, on_step


def _assert_same(
    averaged_model: swa_utils.AveragedModel, params: dict[str, torch.Tensor], atol: float = 0.0
) -> None:
    expected = {k.removeprefix("module."): v for k, v in averaged_model.named_parameters()}
    assert set(expected) == set(params)
    for name, value in params.items():
        assert value.dtype == torch.float64
        torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=atol, msg=name)


def test_ema_matches_averaged_model_bitwise():
    # decays exact in float32 (the state keeps hyperparameters as float32 0-d tensors), so the float64
    # weights equal the reference's Python-float ones bit for bit
    averaged, on_step = _reference({"multi_avg_fn": swa_utils.get_ema_multi_avg_fn(0.875)})
    _, state = _train(optim.chain(optim.sgd(0.1, momentum=0.9), averaging.ema(0.875)), 6, on_step)
    _assert_same(averaged, averaging.averaged_params(state))
    assert int(averaging.find_average(state.opt_state).count) == 6
    # the average really differs from the live params (a test that could fail)
    assert not torch.equal(averaging.averaged_params(state)["0.weight"], state.params["0.weight"])


def test_ema_warmup_matches_averaged_model_with_warmup_decay():
    decay = 0.96875  # 31/32, exact in float32

    def avg_fn(avg, p, n):  # n: averages taken before this one (>= 1 here), as ours counts them
        nf = n.to(torch.float64)
        d = torch.minimum(torch.tensor(decay, dtype=torch.float64), (1 + nf) / (10 + nf))
        return torch.lerp(avg, p, 1 - d)

    averaged, on_step = _reference({"avg_fn": avg_fn})
    _, state = _train(optim.chain(optim.adam(0.05), averaging.ema(decay, warmup=True)), 5, on_step)
    _assert_same(averaged, averaging.averaged_params(state))


def test_swa_matches_averaged_model_default_average():
    start, every = 2, 3
    when = lambda t: t >= start and (t - start) % every == 0  # noqa: E731
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # AveragedModel computes 1 / (n + 1) in the default dtype
    try:
        averaged, on_step = _reference({}, when)
        _, state = _train(optim.chain(optim.sgd(0.2), averaging.swa(start=start, every=every)), 9, on_step)
    finally:
        torch.set_default_dtype(old)
    swa_state = averaging.find_average(state.opt_state)
    assert int(swa_state.n_averaged) == int(averaged.n_averaged) == 3  # steps 2, 5, 8
    # torch's foreach lerp with a Python weight and torch.lerp with a 0-d tensor weight (ours: no host
    # sync) round differently in the last bit on some elements: 1 ulp of these values is ~1e-16
    _assert_same(averaged, averaging.averaged_params(state), atol=1e-16)


def test_ema_resumes_bitwise_through_a_checkpoint(tmp_path):
    tx = optim.chain(optim.adamw(0.05, weight_decay=0.01), averaging.ema(0.95, warmup=True))
    model = _mlp()
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss)), compile=False)
    batches = _batches(6)

    straight = ft.TrainState.create(model, tx)
    for b in batches:
        straight, _ = step(straight, b)

    first = ft.TrainState.create(model, tx)
    for b in batches[:3]:
        first, _ = step(first, b)
    ft.checkpoint.save(tmp_path / "ckpt", first)
    resumed = ft.checkpoint.restore(tmp_path / "ckpt", ft.TrainState.create(model, tx))
    for b in batches[3:]:
        resumed, _ = step(resumed, b)

    a, b = averaging.find_average(straight.opt_state), averaging.find_average(resumed.opt_state)
    assert torch.equal(a.count, b.count) and int(a.count) == 6
    assert torch.equal(a.ema_decay, b.ema_decay)
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), name


def test_ema_decay_is_a_settable_hyperparameter():
    state = optim.chain(optim.sgd(0.1), averaging.ema(0.9)).init({"w": torch.zeros(2)})
    assert float(optim.hyperparams(state)["ema_decay"]) == pytest.approx(0.9)
    state = optim.set_hyperparams(state, ema_decay=0.5)
    assert float(averaging.find_average(state).ema_decay) == 0.5


def test_ema_in_float32_for_bf16_params():
    def run(dtype):
        params = {"w": torch.zeros(3, dtype=torch.bfloat16)}
        tx = optim.chain(optim.sgd(1.0), averaging.ema(0.999, dtype=dtype))
        state = tx.init(params)
        for _ in range(3):  # params -1, -2, -3: exact in bf16
            updates, state = tx.update({"w": torch.ones(3, dtype=torch.bfloat16)}, state, params)
            params = optim.apply_updates(params, updates)
        return averaging.find_average(state).params["w"]

    d = torch.tensor(0.999)
    expected = torch.full((3,), -1.0)
    for p in (-2.0, -3.0):
        expected = torch.lerp(expected, torch.full((3,), p), 1 - d)
    in_float32 = run(torch.float32)
    assert in_float32.dtype == torch.float32 and torch.equal(in_float32, expected)
    in_bf16 = run(None)  # bf16 rounding swallows (1 - decay) * (p - avg): the average never moves
    assert in_bf16.dtype == torch.bfloat16 and torch.equal(
        in_bf16, torch.full((3,), -1.0, dtype=torch.bfloat16)
    )


def test_with_averaged_params_and_eval_callback_swap_back():
    _, state = _train(optim.chain(optim.sgd(0.1), averaging.ema(0.5)), 3)
    swapped = averaging.with_averaged_params(state)
    assert torch.equal(swapped.params["2.bias"], averaging.averaged_params(state)["2.bias"])
    assert swapped.opt_state is state.opt_state

    cb = ft.callbacks.AveragedEvaluation()
    during = cb.on_eval_begin(state, ft.callbacks.Context())
    assert torch.equal(during.params["0.weight"], swapped.params["0.weight"])
    after = cb.on_eval_end(during, ft.callbacks.Context())
    assert after.params is state.params


def test_missing_average_is_a_clear_error():
    state = ft.TrainState.create(torch.nn.Linear(2, 1), optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"chain functrain.optim.averaging.ema\(...\) or swa\(...\) last"):
        averaging.averaged_params(state)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="ema: decay must be in"):
        averaging.ema(1.0)
    with pytest.raises(ValueError, match="swa: every must be an int >= 1"):
        averaging.swa(start=1, every=0)


def test_update_bn_matches_torch_update_bn():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 2)
    ).double()
    tx = optim.chain(optim.sgd(0.1), averaging.swa())
    step = ft.jit(ft.make_train_step(net, ft.supervised_loss(torch.nn.functional.mse_loss)), compile=False)
    state = ft.TrainState.create(net, tx)
    for x, y in _batches(3):
        state, _ = step(state, (x[:, :3], y))
    state = averaging.with_averaged_params(state)
    loader = [(torch.randn(7, 3, dtype=torch.float64), None) for _ in range(4)]

    reference = copy.deepcopy(net)
    state.load_into(reference)
    swa_utils.update_bn(loader, reference)

    before = {k: v.clone() for k, v in net.state_dict().items()}
    new = averaging.update_bn(state, net, loader)
    for name, value in reference.state_dict().items():
        if "running" in name or "num_batches" in name:
            assert torch.equal(new.buffers[name], value), name
    assert not torch.equal(new.buffers["1.running_mean"], state.buffers["1.running_mean"])
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # the module is untouched
    assert net[1].momentum == 0.1 and net.training


@pytest.mark.compile
@pytest.mark.slow
def test_ema_compiles_in_the_one_graph_step_without_recompiles():
    tx = optim.chain(optim.adam(0.05), averaging.ema(0.9, warmup=True))
    model = _mlp()
    make = lambda: ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.mse_loss))  # noqa: E731
    compiled, eager = ft.jit(make()), ft.jit(make(), compile=False)
    a = b = ft.TrainState.create(model, tx)
    for batch in _batches(4):
        a, _ = compiled(a, batch)
        b, _ = eager(b, batch)
    assert compiled.num_compiles == 1, compiled.compile_reasons
    # float32 tolerances although the params are float64: the decay, Adam's hyperparameters and the
    # warmup's (1 + n) / (10 + n) are float32 0-d tensors, which inductor's kernels may carry in another
    # precision than eager's (bitwise here, 2.7e-9 apart on an AVX2-only EPYC). A wrong average is ~1e-2 off.
    for name, value in averaging.averaged_params(a).items():
        torch.testing.assert_close(value, averaging.averaged_params(b)[name], rtol=1.3e-6, atol=1e-5)


def _ema_trainer(tmp_path, **fields) -> ft.Trainer:
    """A small eager Trainer (SGD, 6 steps, evaluating by steps) with the given config fields."""
    from trainer_fixtures import SmallNet, make_dataset, quiet_config

    cfg = quiet_config(
        tmp_path, max_steps=6, eval_strategy="steps", optimizer={"name": "sgd", "lr": 0.5}, **fields
    )
    return ft.Trainer(SmallNet(), cfg, train_dataset=make_dataset(96), eval_dataset=make_dataset(32, seed=1))


def test_trainer_ema_config_trains_evaluates_and_predicts_with_the_average(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    trainer = _ema_trainer(tmp_path, eval_steps=6, save_strategy="no", ema=0.8)
    result = trainer.train()
    average = averaging.find_average(trainer.state.opt_state)
    assert isinstance(average, averaging.EmaState) and int(average.count) == 6

    evaluated = trainer.evaluate()
    loader = trainer._loader(trainer.eval_dataset, 16, train=False)
    step = trainer._jit("eval")
    with_average = ft.evaluate(averaging.with_averaged_params(trainer.state), step, loader)
    live = ft.evaluate(trainer.state, step, loader)
    assert evaluated == with_average != live
    assert result.eval_metrics == with_average  # the in-training evaluation used the average too
    predict_step = trainer._jit("predict")
    expected = ft.predict(averaging.with_averaged_params(trainer.state), predict_step, loader, collect=True)
    assert torch.equal(trainer.predict(trainer.eval_dataset), expected)


def test_trainer_load_best_model_at_end_brings_the_best_checkpoints_average(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from trainer_fixtures import SmallNet

    trainer = _ema_trainer(
        tmp_path,
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        best_model_mode="max",  # "best" = highest loss: an early checkpoint, not the final state
        ema={"decay": 0.5},
    )
    trainer.train()
    manager = ft.checkpoint.CheckpointManager(tmp_path / "run" / "checkpoints", is_writer=False)
    best = manager.best(metric="eval/loss", mode="max")
    assert best < 6
    # how Trainer.load puts a fit checkpoint's state onto a TrainState
    from functrain.checkpoint import restore_onto

    saved = restore_onto(ft.TrainState.create(SmallNet(), trainer.tx), manager.restore(best)["state"])
    got, want = averaging.find_average(trainer.state.opt_state), averaging.find_average(saved.opt_state)
    assert int(got.count) == best
    for name in want.params:
        assert torch.equal(got.params[name], want.params[name]), name
