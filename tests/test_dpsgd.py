"""Per-example gradients (``make_train_step(..., per_example=...)``) and DP-SGD (``ft.optim.dpsgd``):
against a per-example loop of torch.autograd in float64, the noise from the optimizer state's key, and
the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import functrain as ft
from functrain import checkpoint
from functrain.core.hash_normal import normal

CLIP, LR = 2.0, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def _batch(n: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, dtype=torch.float64, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _loss() -> ft.step.LossFn:
    return ft.supervised_loss(F.cross_entropy)


def _train(step: ft.step.Step, state: ft.TrainState, batches: list) -> ft.TrainState:
    for b in batches:
        state, _ = step(state, b)
    return state


def _reference_dpsgd(model: torch.nn.Module, batches: list, momentum: float | None = None) -> dict:
    """DP-SGD at noise 0 from the paper's definition (Abadi et al. 2016, Opacus without its 1e-6): each
    example's gradient by torch.autograd in a Python loop, clipped to CLIP, summed, over the batch size."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buf = {k: torch.zeros_like(v) for k, v in params.items()}
    for x, y in batches:
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        for i in range(len(x)):
            ps = {k: v.clone().requires_grad_() for k, v in params.items()}
            loss = F.cross_entropy(torch.func.functional_call(model, ps, (x[i : i + 1],)), y[i : i + 1])
            grads = dict(zip(ps, torch.autograd.grad(loss, list(ps.values()))))
            norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
            factor = min(1.0, CLIP / float(norm))
            for k in total:
                total[k] += grads[k] * factor
        for k in params:
            g = total[k] / len(x)
            buf[k] = momentum * buf[k] + g if momentum is not None else g
            params[k] = params[k] - LR * buf[k]
    return params


@pytest.mark.parametrize("per_example", [True, 2])
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_dpsgd_at_noise_zero_equals_a_per_example_autograd_loop(per_example: bool | int, momentum) -> None:
    model = _model()
    batches = [_batch(6, seed) for seed in range(3)]
    tx = ft.optim.dpsgd(LR, CLIP, 0.0, seed=0, momentum=momentum)
    state = _train(
        ft.make_train_step(model, _loss(), per_example=per_example), ft.TrainState.create(model, tx), batches
    )
    ref = _reference_dpsgd(model, batches, momentum)
    err = max(float((state.params[k] - ref[k]).abs().max()) for k in ref)
    assert err <= 1e-12
    clipped = ft.optim.per_example_global_norm_clip
    # the batch really had clipped and unclipped examples (else the test would not see the clip)
    grads = torch.func.vmap(
        torch.func.grad(
            lambda p, x, y: F.cross_entropy(torch.func.functional_call(model, p, (x[None],)), y[None])
        ),
        in_dims=(None, 0, 0),
    )(dict(model.named_parameters()), *batches[0])
    n_clipped = int(clipped(list(grads.values()), CLIP)[1])
    assert 0 < n_clipped < 6


def test_the_step_loss_and_grad_norm_are_the_batch_s() -> None:
    model = _model()
    x, y = _batch()
    state = ft.TrainState.create(model, ft.optim.dpsgd(LR, CLIP, 0.0, seed=0))
    _, dp = ft.make_train_step(model, _loss(), per_example=True)(state, (x, y))
    _, plain = ft.make_train_step(model, _loss())(ft.TrainState.create(model, ft.optim.sgd(LR)), (x, y))
    assert float(dp["loss"]) == pytest.approx(float(plain["loss"]), rel=1e-6)
    assert float(dp["grad_norm"]) == pytest.approx(float(plain["grad_norm"]), rel=1e-6)


def test_noise_has_the_dp_standard_deviation_and_comes_from_the_seed() -> None:
    model = _model()
    x, y = _batch(8)
    sigma = 2.0
    step = ft.make_train_step(model, _loss(), per_example=True)
    clean, _ = step(ft.TrainState.create(model, ft.optim.dpsgd(1.0, CLIP, 0.0, seed=0)), (x, y))
    noisy = [
        step(ft.TrainState.create(model, ft.optim.dpsgd(1.0, CLIP, sigma, seed=s)), (x, y))[0]
        for s in (1, 1, 2)
    ]
    diff = torch.cat([(clean.params[k] - noisy[0].params[k]).reshape(-1) for k in clean.params])
    # lr 1: the params moved by the noise / B, whose std is sigma * C / B
    assert float(diff.std()) == pytest.approx(sigma * CLIP / 8, rel=0.25)
    assert all(torch.equal(noisy[0].params[k], noisy[1].params[k]) for k in clean.params)  # same seed
    assert not torch.equal(noisy[0].params["0.weight"], noisy[2].params["0.weight"])  # another seed


def test_noise_draws_are_standard_normal_and_differ_by_count() -> None:
    key = torch.tensor([11, 22])
    a = normal(key, torch.tensor(0), 400_000, torch.float64)
    b = normal(key, torch.tensor(1), 400_000, torch.float64)
    for z in (a, b):
        assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
        assert abs(float((z**4).mean()) - 3) < 0.06  # Gaussian kurtosis
        assert abs(float((z > 1.96).double().mean()) - 0.025) < 0.002
    assert abs(float((a * b).mean())) < 0.01 and abs(float((a[1:] * a[:-1]).mean())) < 0.01
    assert torch.equal(a, normal(key, torch.tensor(0), 400_000, torch.float64))


def test_a_resumed_dp_run_draws_the_same_noise_bitwise(tmp_path: Path) -> None:
    model = _model()
    batches = [_batch(6, s) for s in range(4)]
    step = ft.make_train_step(model, _loss(), per_example=True)
    tx = ft.optim.dpsgd(LR, CLIP, 1.1, seed=7, momentum=0.9)
    whole = _train(step, ft.TrainState.create(model, tx), batches)
    checkpoint.save(
        tmp_path / "s.ckpt", _train(step, ft.TrainState.create(model, tx), batches[:2]), fsync=False
    )
    part = _train(
        step, checkpoint.restore(tmp_path / "s.ckpt", target=ft.TrainState.create(model, tx)), batches[2:]
    )
    assert all(torch.equal(whole.params[k], part.params[k]) for k in whole.params)


def test_without_a_seed_each_optimizer_draws_its_own_key() -> None:
    params = {"w": torch.zeros(3)}
    a = ft.optim.differentially_private_aggregate(1.0, 1.0).init(params)
    b = ft.optim.differentially_private_aggregate(1.0, 1.0).init(params)
    assert not torch.equal(a.key, b.key)


def test_batchnorm_is_refused_naming_the_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match=r"BatchNorm1d '1\.0'.*freeze_batchnorm=True"):
        ft.make_train_step(model, _loss(), per_example=True)
    ft.make_train_step(model, _loss(), per_example=True, freeze_batchnorm=True)  # running statistics: fine


def test_accumulation_and_parallel_strategies_are_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="per_example=N instead of accumulate"):
        ft.make_train_step(model, _loss(), per_example=True, accumulate=2)
    from functrain.distributed.strategy import DataParallel

    with pytest.raises(ValueError, match="DataParallel"):
        ft.make_train_step(model, _loss(), per_example=True, strategy=DataParallel(lambda *a: a[1:]))
    with pytest.raises(ValueError, match="positive int"):
        ft.make_train_step(model, _loss(), per_example=0.5)  # type: ignore[arg-type]


def test_a_padded_batch_is_refused() -> None:
    model = _model()
    x, y = _batch(6)
    padded = ft.data.MaskedBatch((x, y), torch.tensor([True] * 5 + [False]))
    state = ft.TrainState.create(model, ft.optim.dpsgd(LR, CLIP, 0.0, seed=0))
    with pytest.raises(ValueError, match="padded"):
        ft.make_train_step(model, _loss(), per_example=True)(state, padded)


def test_an_optimizer_that_does_not_aggregate_is_refused_and_plain_gradients_to_dpsgd_too() -> None:
    model = _model()
    batch = _batch()
    with pytest.raises(
        ValueError, match=r"per-example gradients and must aggregate them first: ft\.optim\.dpsgd"
    ):
        ft.make_train_step(model, _loss(), per_example=True)(
            ft.TrainState.create(model, ft.optim.sgd(LR)), batch
        )
    state = ft.TrainState.create(model, ft.optim.dpsgd(LR, CLIP, 0.0, seed=0))
    with pytest.raises(ValueError, match=r"per_example=True"):
        ft.make_train_step(model, _loss())(state, batch)


@pytest.mark.compile
def test_the_compiled_dp_step_is_one_graph_and_matches_eager() -> None:
    model = _model()
    batches = [_batch(6, s) for s in range(3)]
    tx = ft.optim.dpsgd(LR, CLIP, 1.0, seed=3)
    step = ft.make_train_step(model, _loss(), per_example=True)
    compiled = ft.jit(step)
    eager_state = compiled_state = ft.TrainState.create(model, tx)
    for b in batches:
        eager_state, _ = step(eager_state, b)
        compiled_state, _ = compiled(compiled_state, b)
    assert compiled.num_compiles == 1, compiled.compile_reasons
    for k in eager_state.params:  # the same noise: integer hashing is exact, log/cos to the last bits
        torch.testing.assert_close(compiled_state.params[k], eager_state.params[k], rtol=1e-12, atol=1e-13)


def test_an_ensemble_of_dp_steps_trains_each_member_as_alone() -> None:
    model = _model()
    tx = ft.optim.dpsgd(LR, CLIP, 0.0, seed=0)
    step = ft.make_train_step(model, _loss(), per_example=True)
    stacked, _ = ft.ensemble.step(step)(
        ft.ensemble.create(model, tx, seeds=[0, 1], share_init=True), _batch()
    )
    alone, _ = step(ft.TrainState.create(model, tx), _batch())
    for k in alone.params:  # vmap over the members of vmap over the examples
        torch.testing.assert_close(stacked.params[k][1], alone.params[k], rtol=1e-12, atol=1e-14)
