"""Weight averaging (``functrain.optim.averaging``): an exponential moving average (EMA) or a stochastic weight average (SWA) of the params.

Why an optimizer transform (and not a callback): the average is training state. Kept in ``opt_state`` it is

- a part of the ``TrainState`` pytree, so every checkpoint saves it and a resume restores it bit-exactly,
  with no extra code in the loop or the checkpoint format;
- updated *inside* the compiled step, in the same graph as the optimizer (no extra launches between steps,
  no host sync: the decay and the counters are 0-d tensors in the state, so nothing recompiles);
- skipped with the rest of the update when an fp16 overflow skips a step, and run once per optimizer
  update (not per micro-batch) under gradient accumulation.

A callback (a state transformer between steps) could only keep the average in its own ``state_dict``, run
it eagerly after every step, and would need the loop to carry it; optax's ``ema`` averages *updates*, not
params. So :func:`ema` and :func:`swa` are transformations to put **last** in a chain: they pass the updates
through unchanged and average ``params + updates``, the params the step is about to return.

What is averaged: the trainable params. Buffers (BatchNorm running statistics) are not optimizer inputs;
an averaged model evaluated with the live buffers is what ``torch.optim.swa_utils.AveragedModel`` does by
default. For SWA (and EMA of a network with BatchNorm) recompute the statistics for the averaged weights
with :func:`update_bn`, as ``torch.optim.swa_utils.update_bn`` does.

Semantics (those of ``torch.optim.swa_utils.AveragedModel``): the first average is a copy of the params;
then EMA: ``avg = lerp(avg, p, 1 - decay)``; SWA: ``avg = lerp(avg, p, 1 / (n + 1))`` with ``n`` the
number averaged so far. With ``warmup=True`` the EMA decay of update ``n`` (0-based) is
``min(decay, (1 + n) / (10 + n))`` (TensorFlow's ``num_updates``, diffusers' ``EMAModel``).

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(3, 1)
    >>> tx = ft.optim.chain(ft.optim.sgd(0.1), ft.optim.averaging.ema(0.999))
    >>> state = ft.TrainState.create(model, tx)
    >>> state = state.apply_gradients({k: torch.ones_like(v) for k, v in state.params.items()})
    >>> torch.equal(ft.optim.averaging.averaged_params(state)["bias"], state.params["bias"])  # first: a copy
    True
    >>> eval_state = ft.optim.averaging.with_averaged_params(state)  # evaluate / export with the average
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch
from torch import nn

from functrain import tree
from functrain.optim._leaves import check_range, flatten_matching, scalar, zero_count
from functrain.optim.base import GradientTransformation, apply_updates
from functrain.optim.hyperparams import hyperparam_field
from functrain.tree import PyTree

__all__ = [
    "EmaState",
    "SwaState",
    "averaged_params",
    "ema",
    "find_average",
    "swa",
    "update_bn",
    "with_averaged_params",
]


@tree.struct
class EmaState:
    """State of :func:`ema`: ``count`` averages taken, the decay (a settable hyperparameter) and the
    averaged params (shaped like the params)."""

    count: torch.Tensor
    ema_decay: torch.Tensor = hyperparam_field()
    params: PyTree = None


@tree.struct
class SwaState:
    """State of :func:`swa`: ``count`` optimizer updates seen, ``n_averaged`` params averaged in, and the
    average (shaped like the params)."""

    count: torch.Tensor
    n_averaged: torch.Tensor
    params: PyTree = None


def _scalar_dtype(params: PyTree) -> torch.dtype:
    """The dtype the averaging weights are computed in: float64 when any param is float64, else float32.

    The decay itself is stored as float32 like every hyperparameter: a float64 0-d input makes dynamo
    treat it as a Python float and restart its analysis once on the first compile.
    """
    dtypes = {x.dtype for x in tree.leaves(params) if isinstance(x, torch.Tensor)}
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _average_copy(params: PyTree, dtype: torch.dtype | None) -> PyTree:
    def one(p: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
        return p.detach().to(dtype=cast, copy=True)

    return tree.map(one, params)


def _lerp_tree(
    who: str, average: PyTree, new_params: PyTree, weight: torch.Tensor, take: torch.Tensor | None = None
) -> PyTree:
    """``lerp(average, new, weight)`` leaf by leaf (where ``take`` is False the average stays)."""
    new_leaves, (avg_leaves,), spec = flatten_matching(who, new_params, average)
    out = []
    for a, p in zip(avg_leaves, new_leaves):
        if not a.is_floating_point():  # integer params are not averaged: they follow the model
            out.append(p.to(a.dtype))
            continue
        mixed = torch.lerp(a, p.to(a.dtype), weight.to(a.dtype))
        out.append(mixed if take is None else torch.where(take, mixed, a))
    return tree.unflatten(spec, out)


def ema(
    decay: float = 0.999, *, warmup: bool = False, dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Keep an exponential moving average of the params in the optimizer state; chain it **last**.

    Args:
        decay: weight of the old average, in [0, 1). A 0-d tensor in the state (``ema_decay``), so
            :func:`functrain.optim.set_hyperparams` can change it without a recompile.
        warmup: use ``min(decay, (1 + n) / (10 + n))`` for the ``n``-th average (0-based), so early
            averages are not dominated by the random initialisation (timm/TF/diffusers warm-up).
        dtype: keep the average in this dtype (e.g. ``torch.float32`` for bf16 params, whose rounding
            would swallow ``(1 - decay) * (p - avg)``); default: each param's dtype.

    The first update copies the params (as ``AveragedModel`` does); later ones do
    ``avg = lerp(avg, p, 1 - decay)`` with ``p`` the params after this update.

    Example:
        >>> import torch
        >>> from functrain import optim
        >>> tx = optim.chain(optim.sgd(1.0), ema(0.5))
        >>> params = {"w": torch.zeros(1)}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.ones(1)}, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> params["w"], state[1].params["w"]   # p: -1 then -2; average: -1, then (-1 + -2) / 2
        (tensor([-2.]), tensor([-1.5000]))
    """
    decay = check_range("ema", "decay", decay, 0.0, 1.0)

    def init(params: PyTree) -> EmaState:
        return EmaState(
            count=zero_count(params),
            ema_decay=scalar(decay, params),
            params=_average_copy(params, dtype),
        )

    def update(updates: PyTree, state: EmaState, params: PyTree | None = None) -> tuple[PyTree, EmaState]:
        if params is None:
            raise ValueError("ema needs the current parameters: call update(updates, state, params)")
        n = state.count
        d = state.ema_decay.to(_scalar_dtype(params))
        if warmup:
            nf = n.to(d.dtype)
            d = torch.minimum(d, (1 + nf) / (10 + nf))
        weight = torch.where(n == 0, torch.ones_like(d), 1 - d)
        average = _lerp_tree("ema", state.params, apply_updates(params, updates), weight)
        return updates, EmaState(count=n + 1, ema_decay=state.ema_decay, params=average)

    return GradientTransformation(init, update)


def swa(start: int = 1, every: int = 1, *, dtype: torch.dtype | None = None) -> GradientTransformation:
    """Keep a stochastic weight average (equal weights) of the params; chain it **last**.

    The params after optimizer updates ``start, start + every, start + 2 * every, ...`` (1-based) are
    averaged: ``avg = lerp(avg, p, 1 / (n + 1))`` with ``n`` the number averaged before (the first is a
    copy), as ``torch.optim.swa_utils.AveragedModel`` with its default average. Pair it with a constant or
    cyclic learning rate after ``start`` (``torch.optim.swa_utils.SWALR``'s role: a schedule here), and
    recompute BatchNorm statistics with :func:`update_bn` before evaluating.

    Example:
        >>> import torch
        >>> from functrain import optim
        >>> tx = optim.chain(optim.sgd(1.0), swa(start=2))
        >>> params = {"w": torch.zeros(1)}
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     updates, state = tx.update({"w": torch.ones(1)}, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> state[1].params["w"], int(state[1].n_averaged)   # mean of -2 and -3
        (tensor([-2.5000]), 2)
    """
    for name, value in (("start", start), ("every", every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"swa: {name} must be an int >= 1, got {value!r}")

    def init(params: PyTree) -> SwaState:
        return SwaState(
            count=zero_count(params), n_averaged=zero_count(params), params=_average_copy(params, dtype)
        )

    def update(updates: PyTree, state: SwaState, params: PyTree | None = None) -> tuple[PyTree, SwaState]:
        if params is None:
            raise ValueError("swa needs the current parameters: call update(updates, state, params)")
        t = state.count + 1
        take = (t >= start) & (torch.remainder(t - start, every) == 0)
        n = state.n_averaged.to(_scalar_dtype(params))
        weight = 1 / (n + 1)
        average = _lerp_tree("swa", state.params, apply_updates(params, updates), weight, take)
        n_averaged = state.n_averaged + take.to(state.n_averaged.dtype)
        return updates, SwaState(count=t, n_averaged=n_averaged, params=average)

    return GradientTransformation(init, update)


# ------------------------------------------------------------------------------------------ reading


def find_average(opt_state: Any) -> EmaState | SwaState:
    """The :class:`EmaState` or :class:`SwaState` inside an optimizer state (exactly one must be there).

    Example:
        >>> from functrain import optim
        >>> find_average(optim.chain(optim.sgd(0.1), ema()).init({"w": torch.zeros(1)})).count
        tensor(0)
    """
    found = [
        x
        for x in optree.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, (EmaState, SwaState)), namespace=tree.NAMESPACE
        )
        if isinstance(x, (EmaState, SwaState))
    ]
    if len(found) != 1:
        raise ValueError(
            f"averaging: the optimizer state holds {len(found)} weight averages, expected one; chain "
            "functrain.optim.averaging.ema(...) or swa(...) last in the optimizer, e.g. "
            "optim.chain(optim.adamw(1e-3), averaging.ema(0.999))"
        )
    return found[0]


def averaged_params(state: Any) -> PyTree:
    """The averaged params of a ``TrainState`` (or of an optimizer state), in the params' dtypes.

    A sharded state's average is kept as its params are: shards under ZeRO-3; under ZeRO-1/2 (params
    whole, optimizer state sharded) its rows are all-gathered, so every rank must call it.

    Example:
        >>> import functrain as ft
        >>> s = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.chain(ft.optim.sgd(0.1), ema()))
        >>> sorted(averaged_params(s))
        ['bias', 'weight']
    """
    opt_state = getattr(state, "opt_state", state)
    average = find_average(opt_state).params
    params = getattr(state, "params", None)
    if params is None:
        return average
    layout = getattr(state, "layout", None)
    if layout is not None:  # a sharded state: the optimizer keeps this rank's rows of the average
        average = layout.at_rest(average)  # as the params are kept: shards (ZeRO-3) or gathered whole
    return tree.map(lambda a, p: a.to(p.dtype), average, params)


def with_averaged_params(state: Any) -> Any:
    """``state`` with its params replaced by the average: evaluate, export (``state_dict()``), or save it.

    Example:
        >>> import functrain as ft
        >>> s = ft.TrainState.create(torch.nn.Linear(2, 1), ft.optim.chain(ft.optim.sgd(0.1), swa()))
        >>> with_averaged_params(s).state_dict().keys()
        dict_keys(['weight', 'bias'])
    """
    return state.replace(params=averaged_params(state))


# ------------------------------------------------------------------------------------------ BatchNorm


def update_bn(
    state: Any,
    model: nn.Module,
    batches: Iterable[Any],
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> Any:
    """Recompute BatchNorm running statistics for ``state``'s params over ``batches``; returns the new state.

    ``torch.optim.swa_utils.update_bn`` for a functional state: every ``_BatchNorm`` buffer is reset, the
    model runs in train mode with ``momentum=None`` (a cumulative average over all batches) on
    ``state.params`` (typically :func:`with_averaged_params`), and the resulting statistics become
    ``state.buffers``. ``model`` only provides the architecture: its own tensors are not touched.

    Args:
        forward: ``forward(module, batch)`` runs the model on a batch; default: ``module(batch[0])`` for a
            tuple/list batch, ``module(batch)`` otherwise (``update_bn``'s convention).

    Example:
        >>> import functrain as ft
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        >>> s = ft.TrainState.create(net, ft.optim.chain(ft.optim.sgd(0.1), swa()))
        >>> s = update_bn(with_averaged_params(s), net, [torch.randn(8, 2)])
    """
    bn_modules = {
        name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }
    if not bn_modules:
        return state
    buffers = {k: v.clone() for k, v in state.buffers.items()}
    for name, m in bn_modules.items():
        prefix = f"{name}." if name else ""
        if m.track_running_stats and f"{prefix}running_mean" in buffers:
            buffers[f"{prefix}running_mean"].zero_()
            buffers[f"{prefix}running_var"].fill_(1)
            buffers[f"{prefix}num_batches_tracked"].zero_()
    momenta = {m: m.momentum for m in bn_modules.values()}
    was_training = model.training
    runner = _Forward(model, forward or _default_forward)
    tensors = {f"model.{k}": v for k, v in {**state.params, **buffers}.items()}
    for alias, canonical in getattr(state, "tied", ()):
        if f"model.{canonical}" in tensors:
            tensors[f"model.{alias}"] = tensors[f"model.{canonical}"]
    try:
        model.train()
        for m in bn_modules.values():
            m.momentum = None
        with torch.no_grad():
            for batch in batches:
                # BatchNorm updates the running statistics in place: in our clones in ``buffers``
                torch.func.functional_call(runner, tensors, (batch,), strict=False, tie_weights=False)
    finally:
        for m, momentum in momenta.items():
            m.momentum = momentum
        model.train(was_training)
    return state.replace(buffers=buffers)


class _Forward(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch: Any) -> Any:
        return self.fn(self.model, batch)


def _default_forward(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return module(batch)
