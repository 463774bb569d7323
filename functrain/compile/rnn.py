"""``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` as plain tensor code, so a compiled step can train them.

Dynamo refuses to trace torch's recurrent modules ("Dynamo does not support RNN, GRU, or LSTM"), and
with ``torch._dynamo.config.allow_rnn`` their fused kernel fails under ``torch.func`` ("Cannot access
storage of TensorWrapper"). :func:`rnn_forward` computes the same thing from the module's own weights
(same layout, same gate equations as torch's): one matmul for the input projection of every time step,
then a Python loop over time steps. While a compiled ``ft.jit`` step runs, :func:`functional_rnns`
swaps it in for every recurrent module of the model (eager steps keep torch's kernel).

The loop is unrolled when compiled: compile time grows with the sequence length (measured in
benchmarks/README.md), run time does not change.

Example:
    >>> gru = torch.nn.GRU(4, 8, num_layers=2, batch_first=True)
    >>> x = torch.randn(3, 5, 4)
    >>> out, h = rnn_forward(gru, x)
    >>> out.shape, h.shape
    (torch.Size([3, 5, 8]), torch.Size([2, 3, 8]))
    >>> expected, expected_h = gru(x)  # torch's kernel: the same numbers
    >>> torch.allclose(out, expected, atol=1e-6), torch.allclose(h, expected_h, atol=1e-6)
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from functrain.core.patch import patched

__all__ = ["functional_rnns", "rnn_forward"]

_RECURRENT = (nn.RNN, nn.GRU, nn.LSTM)
_FORWARDS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

Cell = Callable[[torch.Tensor, Any, dict[str, Any]], tuple[torch.Tensor, Any]]


def _rnn_cell(nonlinearity: str) -> Cell:
    act = torch.tanh if nonlinearity == "tanh" else torch.relu

    def cell(xw: torch.Tensor, h: torch.Tensor, w: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        h = act(xw + _linear(h, w["hh"], w["b_hh"]))
        return h, h

    return cell


def _gru_cell(xw: torch.Tensor, h: torch.Tensor, w: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x_r, x_z, x_n = xw.chunk(3, -1)
    h_r, h_z, h_n = _linear(h, w["hh"], w["b_hh"]).chunk(3, -1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    h = (1 - z) * n + z * h
    return h, h


def _lstm_cell(xw: torch.Tensor, state: Any, w: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    h, c = state
    i, f, g, o = (xw + _linear(h, w["hh"], w["b_hh"])).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    if w["hr"] is not None:  # proj_size > 0
        h = h @ w["hr"].t()
    return h, (h, c)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _weights(module: nn.RNNBase, layer: int, reverse: bool) -> dict[str, Any]:
    suffix = f"_l{layer}{'_reverse' if reverse else ''}"

    def get(kind: str) -> torch.Tensor | None:
        return getattr(module, f"{kind}{suffix}", None)

    return {
        "ih": get("weight_ih"),
        "hh": get("weight_hh"),
        "b_ih": get("bias_ih") if module.bias else None,
        "b_hh": get("bias_hh") if module.bias else None,
        "hr": get("weight_hr") if getattr(module, "proj_size", 0) > 0 else None,
    }


def _direction(
    cell: Cell, x: torch.Tensor, state: Any, w: dict[str, Any], reverse: bool
) -> tuple[torch.Tensor, Any]:
    xw = _linear(x, w["ih"], w["b_ih"])  # every time step's input projection in one matmul
    steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    outputs: list[torch.Tensor] = [x] * x.shape[0]
    for t in steps:
        outputs[t], state = cell(xw[t], state, w)
    return torch.stack(outputs), state


def rnn_forward(module: nn.RNNBase, input: torch.Tensor, hx: Any = None) -> tuple[torch.Tensor, Any]:
    """``module(input, hx)`` for an ``nn.RNN``/``nn.GRU``/``nn.LSTM``, as a loop of tensor operations.

    Same arguments and results as the module's ``forward``: ``batch_first``, bidirectional, several
    layers with dropout between them (in training mode), an optional initial state, unbatched input,
    LSTM's ``proj_size``. ``PackedSequence`` input is refused: pad the batch instead (and mask the loss,
    or pick each sequence's last valid output).

    Example:
        >>> lstm = torch.nn.LSTM(4, 8, bidirectional=True)
        >>> out, (h, c) = rnn_forward(lstm, torch.randn(5, 3, 4))
        >>> out.shape
        torch.Size([5, 3, 16])
    """
    if isinstance(input, PackedSequence):
        raise TypeError(
            f"{type(module).__name__}: functrain runs recurrent modules as a loop of tensor operations "
            "(so that compiled steps can train them), which does not take a PackedSequence. Pad the "
            "batch to one length instead (mask the loss, or gather each sequence's last valid output)."
        )
    if isinstance(module, nn.LSTM):
        cell: Cell = _lstm_cell
    elif isinstance(module, nn.GRU):
        cell = _gru_cell
    else:
        cell = _rnn_cell(module.nonlinearity)
    is_lstm = isinstance(module, nn.LSTM)
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(1)
    if module.batch_first and batched:
        x = x.transpose(0, 1)
    directions = 2 if module.bidirectional else 1
    batch = x.shape[1]
    out_size = module.proj_size if is_lstm and module.proj_size > 0 else module.hidden_size
    if hx is None:
        h0 = x.new_zeros(module.num_layers * directions, batch, out_size)
        c0 = x.new_zeros(module.num_layers * directions, batch, module.hidden_size) if is_lstm else None
    elif is_lstm:
        h0, c0 = hx if batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
    else:
        h0, c0 = (hx if batched else hx.unsqueeze(1)), None

    h_n, c_n = [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(directions):
            k = layer * directions + d
            state = (h0[k], c0[k]) if is_lstm else h0[k]
            out, state = _direction(cell, x, state, _weights(module, layer, d == 1), reverse=d == 1)
            outs.append(out)
            h_n.append(state[0] if is_lstm else state)
            if is_lstm:
                c_n.append(state[1])
        x = outs[0] if directions == 1 else torch.cat(outs, -1)
        if module.dropout and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, module.training)

    output = x.transpose(0, 1) if module.batch_first and batched else x
    h = torch.stack(h_n)
    hidden: Any = (h, torch.stack(c_n)) if is_lstm else h
    if not batched:
        output = output.squeeze(1)
        hidden = (hidden[0].squeeze(1), hidden[1].squeeze(1)) if is_lstm else hidden.squeeze(1)
    return output, hidden


_FOUND: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


def _recurrent_modules(model: nn.Module) -> list[nn.Module]:
    # Found once per model (this runs before every step call; walking a large model costs ~0.1 ms).
    if model not in _FOUND:
        _FOUND[model] = [m for m in model.modules() if isinstance(m, _RECURRENT)]
    return _FOUND[model]


@contextlib.contextmanager
def functional_rnns(model: Any) -> Iterator[None]:
    """Run every ``nn.RNN``/``nn.GRU``/``nn.LSTM`` of ``model`` through :func:`rnn_forward` while the block
    runs (and let dynamo trace them: ``torch._dynamo.config.allow_rnn``); restored on exit. The
    recurrent modules are found on the first call for a model: add none to it afterwards.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.LSTM(4, 8))
        >>> with functional_rnns(model):
        ...     model[0].forward.func is rnn_forward, torch._dynamo.config.allow_rnn
        (True, True)
        >>> "forward" in vars(model[0]), torch._dynamo.config.allow_rnn  # restored on exit
        (False, False)
    """
    modules = _recurrent_modules(model) if isinstance(model, nn.Module) else []
    if not modules or all(m in _FORWARDS and m.__dict__.get("forward") is _FORWARDS[m] for m in modules):
        yield  # nothing to route, or already routed (nested steps)
        return
    for m in modules:
        # The same object every call: dynamo guards on its identity (a new one would recompile).
        if m not in _FORWARDS:
            _FORWARDS[m] = functools.partial(rnn_forward, m)
    import torch._dynamo  # here, not at module level: an eager step never loads dynamo

    config = torch._dynamo.config
    allow = config.allow_rnn
    config.allow_rnn = True
    try:
        with patched((m, "forward", _FORWARDS[m]) for m in modules):  # a forward set before comes back
            yield
    finally:
        config.allow_rnn = allow
