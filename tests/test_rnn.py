"""Recurrent modules as tensor loops (functrain.compile.rnn): torch's outputs and gradients, and compiled steps."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn

import functrain as ft
from functrain.compile.rnn import functional_rnns, rnn_forward

CASES = [
    (nn.GRU, {}),
    (nn.GRU, {"batch_first": True, "bidirectional": True, "num_layers": 2}),
    (nn.LSTM, {}),
    (nn.LSTM, {"batch_first": True, "bidirectional": True, "num_layers": 3}),
    (nn.LSTM, {"proj_size": 3, "num_layers": 2}),
    (nn.RNN, {"nonlinearity": "relu", "bias": False}),
    (nn.RNN, {"num_layers": 2, "bidirectional": True}),
]


def _module(cls: type[nn.RNNBase], kwargs: dict) -> nn.RNNBase:
    torch.manual_seed(0)
    return cls(4, 5, **kwargs).double()


def _inputs(module: nn.RNNBase, with_h0: bool, batched: bool = True) -> tuple:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    if not module.batch_first:
        x = x.transpose(0, 1).contiguous()
    if not batched:
        x = x[:, 0] if not module.batch_first else x[0]
    if not with_h0:
        return (x,)
    layers = module.num_layers * (2 if module.bidirectional else 1)
    shape = (layers, 2) if batched else (layers,)
    out_size = getattr(module, "proj_size", 0) or module.hidden_size
    h0 = torch.randn(*shape, out_size, generator=g, dtype=torch.float64)
    if isinstance(module, nn.LSTM):
        return (x, (h0, torch.randn(*shape, module.hidden_size, generator=g, dtype=torch.float64)))
    return (x, h0)


def _flat(out: object) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("cls,kwargs", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("with_h0", [False, True])
def test_outputs_and_gradients_match_torch(cls: type[nn.RNNBase], kwargs: dict, with_h0: bool) -> None:
    module = _module(cls, kwargs)
    inputs = _inputs(module, with_h0)
    params = dict(module.named_parameters())

    def loss(p: dict, routed: bool) -> torch.Tensor:
        with functional_rnns(module) if routed else contextlib.nullcontext():
            out = torch.func.functional_call(module, p, inputs)
        return sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum() for t in _flat(out))

    expected = module(*inputs)
    got = rnn_forward(module, *inputs)
    for a, b in zip(_flat(got), _flat(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    g_ref = torch.func.grad(loss)(params, False)
    g = torch.func.grad(loss)(params, True)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM, nn.RNN])
def test_unbatched_input(cls: type[nn.RNNBase]) -> None:
    module = _module(cls, {"num_layers": 2})
    inputs = _inputs(module, with_h0=True, batched=False)
    for a, b in zip(_flat(rnn_forward(module, *inputs)), _flat(module(*inputs)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_dropout_between_layers_only_in_training() -> None:
    module = _module(nn.GRU, {"num_layers": 2, "dropout": 0.5})
    (x,) = _inputs(module, with_h0=False)
    module.eval()
    torch.testing.assert_close(rnn_forward(module, x)[0], module(x)[0], rtol=1e-10, atol=1e-10)
    module.train()
    torch.manual_seed(0)
    a = rnn_forward(module, x)[0]
    torch.manual_seed(0)
    b = rnn_forward(module, x)[0]
    assert torch.equal(a, b) and not torch.allclose(a, module.eval()(x)[0])


def test_packed_sequence_is_refused() -> None:
    module = _module(nn.GRU, {})
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(6, 2, 4, dtype=torch.float64), [6, 3])
    with pytest.raises(TypeError, match=r"PackedSequence.*Pad the batch"):
        rnn_forward(module, packed)


class SequenceClassifier(nn.Module):
    def __init__(self, cls: type[nn.RNNBase] = nn.GRU) -> None:
        super().__init__()
        self.rnn = cls(4, 8, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def test_routing_swaps_and_restores_forward() -> None:
    model = SequenceClassifier()
    with functional_rnns(model):
        assert "forward" in model.rnn.__dict__ and torch._dynamo.config.allow_rnn
    assert "forward" not in model.rnn.__dict__ and not torch._dynamo.config.allow_rnn


def test_routing_puts_back_a_forward_set_on_the_module() -> None:
    """A forward the module already had on itself (a hook, ft.remat, a partial) survives the block, and
    a partial one does not make the block think the module is routed already."""
    gru = nn.GRU(3, 4, batch_first=True)
    own = functools.partial(nn.GRU.forward, gru)
    gru.forward = own
    with functional_rnns(gru):
        assert gru.forward is not own and gru.forward.func is rnn_forward
    assert gru.__dict__["forward"] is own


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_compiled_step_trains_rnn_like_eager_torch(cls: type[nn.RNNBase]) -> None:
    torch.manual_seed(0)
    model = SequenceClassifier(cls)
    state = ft.TrainState.create(model, ft.optim.adam(1e-2))
    step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy))
    compiled = ft.jit(step)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 5, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
    out, ref = state, state
    for _ in range(2):
        out, _ = compiled(out, batch)
        ref, _ = step(ref, batch)  # not jitted: torch's own RNN kernel
    assert compiled.num_compiles == 1
    for name in ref.params:
        torch.testing.assert_close(out.params[name], ref.params[name], rtol=1e-5, atol=1e-5)


def test_eager_steps_keep_torch_kernel() -> None:
    from functrain.compile.traceable import traceable

    model = SequenceClassifier()
    with traceable(model, compiled=False):
        assert "forward" not in model.rnn.__dict__
    with traceable(model):
        assert "forward" in model.rnn.__dict__
