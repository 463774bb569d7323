"""The train step's stages, one at a time: micro-batch shares, the weighted sums, the unscaling and
non-finite guard, the update with the strategy's norm, and the parallel strategies' one protocol."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import classification_batch, mlp

import functrain as ft
from functrain.core.masked_batch import MaskedBatch
from functrain.distributed.strategy import DataParallel, Replicated
from functrain.precision import LossScale
from functrain.step import train as train_module


def test_micro_batch_shares_are_their_fractions_of_the_examples() -> None:
    batch = (torch.arange(7.0), torch.arange(7))
    parts = train_module._micro_batches(batch, None, 3)
    assert [len(mb[0]) for mb, _, _ in parts] == [3, 2, 2]
    assert [share for _, share, _ in parts] == [3 / 7, 2 / 7, 2 / 7]
    assert train_module._micro_batches(batch, None, 1) == [(batch, 1.0, ())]


def test_a_padded_batch_counts_each_micro_batch_once_through_its_mask() -> None:
    batch = (torch.arange(4.0), torch.arange(4))
    mask = torch.tensor([True, True, True, False])
    parts = train_module._micro_batches(batch, mask, 2)
    assert [share for _, share, _ in parts] == [1.0, 1.0]
    masks = [masking[0] for _, _, masking in parts]
    assert [m.tolist() for m in masks] == [[True, True], [True, False]]
    assert all(float(masking[1]) == 3.0 for _, _, masking in parts)  # the whole batch's real examples


def test_accumulated_sums_are_weighted_by_share() -> None:
    acc = train_module._Accumulated({}, {}, torch.device("cpu"))
    for share, value in ((0.25, 4.0), (0.75, 8.0)):
        aux = {"metrics": {"m": torch.tensor(value)}, "preds": torch.ones(1), "target": torch.zeros(1)}
        acc.add({"w": torch.full((2,), value * share)}, torch.tensor(value), aux, share)
    assert float(acc.loss) == 0.25 * 4 + 0.75 * 8
    assert float(acc.extra["m"]) == 7.0
    assert acc.grads["w"].tolist() == [7.0, 7.0]
    assert len(acc.preds) == len(acc.targets) == 2


def test_unscale_divides_by_the_loss_scale_and_reports_finiteness() -> None:
    grads = {"w": torch.tensor([4.0, 8.0])}
    assert train_module._unscale(grads, None) == (grads, None, None)
    scale = LossScale.create(init_scale=4.0)
    out, _, finite = train_module._unscale(grads, scale)
    assert out["w"].tolist() == [1.0, 2.0] and bool(finite)
    _, shrunk, finite = train_module._unscale({"w": torch.tensor([float("inf")])}, scale)
    assert not bool(finite) and float(shrunk.scale) < 4.0


class _Doubling(Replicated):
    """A strategy whose norm counts every leaf twice and whose reduce halves the loss; records calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.norm = lambda leaves: [2 * torch.linalg.vector_norm(x) for x in leaves]

    def reduce(self, state, grads, loss, metrics, buffers, examples):  # type: ignore[no-untyped-def]
        self.calls.append("reduce")
        return grads, loss / 2, dict(metrics), dict(buffers)

    def params_at_rest(self, state, params):  # type: ignore[no-untyped-def]
        self.calls.append("at_rest")
        return params


def test_update_uses_the_strategy_norm_for_clipping_and_grad_norm() -> None:
    model = mlp()
    tx = ft.optim.chain(ft.optim.clip_by_global_norm(1e-3), ft.optim.sgd(1.0))
    state = ft.TrainState.create(model, tx, seed=0)
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    strategy = _Doubling()
    local = train_module._update(state, grads, Replicated(), in_place=False)
    doubled = train_module._update(state, grads, strategy, in_place=False)
    assert float(doubled[2]) == pytest.approx(2 * float(local[2]))
    k = next(iter(state.params))
    moved = (state.params[k] - doubled[0][k]).abs().max() / (state.params[k] - local[0][k]).abs().max()
    assert float(moved) == pytest.approx(0.5, rel=1e-4)  # clipped to the doubled norm: half the step
    assert strategy.calls == ["at_rest"]


def test_a_step_given_a_strategy_runs_its_stages() -> None:
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    loss = ft.supervised_loss(F.cross_entropy)
    strategy = _Doubling()
    _, plain = ft.make_train_step(model, loss)(state, classification_batch())
    _, ours = ft.make_train_step(model, loss, strategy=strategy)(state, classification_batch())
    assert strategy.calls == ["reduce", "at_rest"]
    assert float(ours["loss"]) == pytest.approx(float(plain["loss"]) / 2)
    assert float(ours["grad_norm"]) == pytest.approx(2 * float(plain["grad_norm"]))
    with pytest.raises(ValueError, match="not both"):
        ft.make_train_step(model, loss, strategy=strategy, gradient_reducer=DataParallel(None).reduce)


def test_data_parallel_calls_its_reducer_with_the_one_protocol() -> None:
    seen = []

    def reducer(state, grads, loss, metrics, buffers, examples):  # type: ignore[no-untyped-def]
        seen.append((state, examples))
        return grads, loss, metrics, buffers

    out = DataParallel(reducer).reduce("state", {"w": torch.ones(1)}, torch.ones(()), {}, {}, 5)
    assert seen == [("state", 5)] and torch.equal(out[0]["w"], torch.ones(1))
    assert DataParallel(reducer).counts_examples and not Replicated().counts_examples


def test_padded_batch_examples_reach_the_reducer_as_the_mask_count() -> None:
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    seen = []

    def reducer(state, grads, loss, metrics, buffers, examples):  # type: ignore[no-untyped-def]
        seen.append(examples)
        return grads, loss, metrics, buffers

    x, y = classification_batch()
    mask = torch.arange(len(y)) < 5
    step = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy), gradient_reducer=reducer)
    step(state, MaskedBatch((x, y), mask))
    assert int(seen[0]) == 5
    assert isinstance(seen[0], torch.Tensor)  # counted on the device, not on the host


@pytest.mark.parametrize("traced", [False, True])
def test_model_call_swaps_the_tensors_in_and_a_shared_modules_own_back(traced: bool) -> None:
    # One Linear reached by two names ("0.weight" and its tied alias "2.weight"): the same slot is
    # swapped twice, and the originals go back in reverse order, so the module keeps its own Parameter.
    from functrain.step.bind import model_call

    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), shared)
    own = dict(shared._parameters)
    params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    x = torch.randn(2, 3)

    def run(params: dict, x: torch.Tensor) -> torch.Tensor:
        return model_call(model)(params, {})(x)

    if traced:
        torch._dynamo.reset()
        run = torch.compile(run, backend="eager", fullgraph=True)
    out = run(params, x)
    assert all(shared._parameters[k] is v for k, v in own.items())
    assert torch.equal(out, torch.func.functional_call(model, params, (x,)))  # (which keeps no identity)
