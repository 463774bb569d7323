"""functrain on a CUDA GPU: compiled steps, mixed precision, donation, checkpoints, fit and Trainer.

Every test runs on ``device``: ``"cuda"`` (marked ``cuda``, skipped without a GPU) and ``"cpu"``, so the
test bodies themselves are checked on any machine. Steps are compiled on CUDA; the CPU variants run
eagerly except where compilation is the point (those are marked ``compile``), since test_jit.py covers
compilation on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import SmallCNN, classification_batch, mlp
from test_checkpoint_helpers import assert_bit_equal
from trainer_fixtures import SmallNet, make_dataset

import functrain as ft
from functrain import checkpoint

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
on_devices = pytest.mark.parametrize("device", [CUDA, "cpu"])
compiled_on_devices = pytest.mark.parametrize(
    "device", [CUDA, pytest.param("cpu", marks=[pytest.mark.compile, pytest.mark.slow])]
)


def compiles(device: str) -> bool:
    return device == "cuda"


def loss_fn():
    return ft.supervised_loss(F.cross_entropy)


def on(device, batch):
    return tuple(t.to(device) for t in batch)


def close(a, b, **tolerances):
    for x, y in zip(ft.tree.leaves(a), ft.tree.leaves(b)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            torch.testing.assert_close(x, y, **tolerances)


@compiled_on_devices
def test_compiled_step_with_a_schedule_compiles_once(device):
    torch.manual_seed(0)
    model = mlp()
    tx = ft.optim.adamw(ft.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20), weight_decay=0.01)
    state = ft.TrainState.create(model, tx, device=device)
    step_fn = ft.make_train_step(model, loss_fn())
    compiled, eager = ft.jit(step_fn), ft.jit(step_fn, compile=False)
    batch = on(device, classification_batch(32))
    c_state = e_state = state
    for _ in range(12):  # the learning rate changes every step
        c_state, cm = compiled(c_state, batch)
        e_state, em = eager(e_state, batch)
    assert compiled.num_compiles == 1, compiled.compile_reasons
    assert c_state.params["0.weight"].device.type == device
    torch.testing.assert_close(cm["loss"], em["loss"], rtol=1e-4, atol=1e-5)
    close(c_state.params, e_state.params, rtol=1e-3, atol=1e-4)


@on_devices
def test_bf16_step_trains_and_keeps_float32_state(device):
    torch.manual_seed(0)
    model = SmallCNN(dropout=0.0)
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), device=device)
    step = ft.jit(ft.make_train_step(model, loss_fn(), precision="bf16"), compile=compiles(device))
    reference = ft.jit(ft.make_train_step(model, loss_fn()), compile=False)
    batch = on(device, (torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))))
    first, m = step(state, batch)
    _, em = reference(state, batch)
    assert all(p.dtype == torch.float32 for p in first.params.values())
    torch.testing.assert_close(m["loss"], em["loss"], rtol=2e-2, atol=2e-2)  # bf16 has 8 mantissa bits
    losses = [m["loss"]]
    for _ in range(10):
        first, m = step(first, batch)
        losses.append(m["loss"])
    assert losses[-1] < 0.5 * losses[0]
    assert step.num_compiles == (1 if compiles(device) else 0)


@on_devices
def test_fp16_loss_scaling_skips_overflows_and_trains(device):
    torch.manual_seed(0)
    model = mlp()
    tx = ft.optim.sgd(0.1)
    # 2**40 overflows fp16 gradients (max 65504) on the first step: the update is skipped, the scale halves
    scale = ft.precision.LossScale.create(init_scale=2.0**40, growth_interval=1000)
    state = ft.TrainState.create(model, tx, device=device, loss_scale=scale)
    step = ft.jit(ft.make_train_step(model, loss_fn(), precision="fp16"), compile=compiles(device))
    batch = on(device, classification_batch(32))
    skipped, m = step(state, batch)
    close(skipped.params, state.params, rtol=0, atol=0)
    assert float(m["loss_scale"]) == float(skipped.loss_scale.scale) == 2.0**39
    # a sane scale: the update is the fp32 one up to fp16 rounding
    scale = state.loss_scale.scale
    sane = state.replace(loss_scale=state.loss_scale.replace(scale=torch.full_like(scale, 2.0**10)))
    updated, _ = step(sane, batch)
    expected, _ = ft.jit(ft.make_train_step(model, loss_fn()), compile=False)(state, batch)
    assert not torch.equal(updated.params["0.weight"], state.params["0.weight"])
    close(updated.params, expected.params, rtol=1e-2, atol=1e-3)
    assert step.num_compiles == (1 if compiles(device) else 0)


@on_devices
def test_donating_step_reuses_the_state_and_equals_the_pure_step(device):
    torch.manual_seed(0)
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2), device=device)
    step_fn = ft.make_train_step(model, loss_fn())
    donating = ft.jit(step_fn, donate=True, compile=compiles(device))
    batch = on(device, classification_batch(32))
    expected, _ = ft.jit(step_fn, compile=False)(state, batch)
    given = ft.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    weight = given.params["0.weight"]
    out, _ = donating(given, batch)
    assert out.params["0.weight"] is weight  # written in place
    close(out.params, expected.params, rtol=1e-4, atol=1e-6)
    with pytest.raises(ft.DonatedStateError):
        donating(given, batch)


@on_devices
def test_checkpoint_of_a_device_state_round_trips_and_restores_onto_the_cpu(device, tmp_path: Path):
    torch.manual_seed(0)
    model, tx = mlp(), ft.optim.adam(1e-2)
    state = ft.TrainState.create(model, tx, device=device)
    state, _ = ft.jit(ft.make_train_step(model, loss_fn()), compile=False)(
        state, on(device, classification_batch())
    )
    checkpoint.save(tmp_path / "s.ckpt", state, step=1)
    fresh = ft.TrainState.create(mlp(), tx, device=device)
    back = checkpoint.restore(tmp_path / "s.ckpt", target=fresh)
    assert back.params["0.weight"].device.type == device
    assert_bit_equal(back.to("cpu"), state.to("cpu"))
    on_cpu = checkpoint.restore(tmp_path / "s.ckpt", target=fresh.to("cpu"))
    assert on_cpu.params["0.weight"].device.type == "cpu"
    assert_bit_equal(on_cpu, state.to("cpu"))


@on_devices
def test_fit_from_a_cpu_dataset_with_both_evaluation_paths(device):
    torch.manual_seed(0)
    model = mlp()
    metrics = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    train_step = ft.jit(ft.make_train_step(model, loss_fn()), compile=compiles(device))
    eval_step = ft.jit(ft.make_eval_step(model, loss_fn(), metrics=metrics), compile=compiles(device))
    data = list(zip(*classification_batch(64)))  # CPU tensors, as a user's dataset holds them
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0, device=device)
    result = ft.fit(
        state, train_step, data, batch_size=16, epochs=3, progress_bar=False,
        eval_step=eval_step, eval_data=data, eval_every="epoch",
    )  # fmt: skip
    assert int(result.state.step) == 12 and result.state.params["0.weight"].device.type == device
    again = ft.evaluate(result.state, eval_step, data, batch_size=16)
    assert again == pytest.approx(result.eval_metrics, rel=1e-5)
    # the same run on the CPU, eagerly: the device run computes the same thing
    cpu = ft.fit(
        ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0), ft.jit(train_step.fn, compile=False),
        data, batch_size=16, epochs=3, progress_bar=False,
    )  # fmt: skip
    close(result.state.params, cpu.state.to(device).params, rtol=1e-3, atol=1e-4)
    preds = ft.predict(result.state, ft.make_predict_step(model), [x for x, _ in data], batch_size=16,
                       collect=True)  # fmt: skip
    assert preds.shape == (64, 3) and preds.device.type == device


@on_devices
def test_trainer_end_to_end_on_the_device(device, tmp_path: Path):
    torch.manual_seed(0)
    config = ft.TrainerConfig(
        output_dir=str(tmp_path / "run"), epochs=2, batch_size=16, device=device,
        compile=compiles(device), mixed_precision="bf16" if device == "cuda" else "no",
        metrics={"accuracy": {}}, progress_bar=False,
    )  # fmt: skip
    trainer = ft.Trainer(SmallNet(), config, make_dataset(96), make_dataset(32, seed=1))
    result = trainer.train()
    assert int(result.state.step) == 12 and result.state.params["head.weight"].device.type == device
    assert 0.0 <= result.eval_metrics["eval/accuracy"] <= 1.0
    assert trainer.evaluate(make_dataset(32, seed=1)) == pytest.approx(result.eval_metrics, rel=1e-4)
    assert trainer.predict(make_dataset(8, seed=2)).shape == (8, 3)
