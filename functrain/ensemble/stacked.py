"""Stacked train states: N members in one :class:`~functrain.TrainState` whose every leaf has a leading
member axis.

A stacked state is an ordinary ``TrainState``: ``step`` is ``[n]``, ``rng`` is ``[n, 2]``, a ``[out, in]``
weight is ``[n, out, in]``, a hyperparameter that lives in the optimizer state (learning rate, weight
decay) is ``[n]``. It checkpoints, moves (``.to``) and donates like one model; :func:`member` takes one
member out as a plain state and :func:`stack` puts plain states together.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> state = ft.ensemble.create(model, ft.optim.adamw(1e-3), seeds=[0, 1, 2],
    ...                            hyperparams={"learning_rate": [1e-3, 3e-3, 1e-2]})
    >>> state.params["weight"].shape, ft.ensemble.size(state)
    (torch.Size([3, 2, 4]), 3)
    >>> one = ft.ensemble.member(state, 1)
    >>> float(ft.optim.hyperparams(one.opt_state)["learning_rate"])
    0.003000000026077032
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from functrain import optim, tree
from functrain.core.member_axis import is_ensemble, size
from functrain.optim import GradientTransformation
from functrain.state import TrainState

__all__ = [
    "create",
    "initialise",
    "member",
    "members",
    "run_key",
    "run_step",
    "stack",
]


def run_key(state: Any) -> torch.Tensor:
    """The key that orders the run's data: the state's own key, or member 0's for an ensemble (all members
    see the same batches)."""
    rng = state.rng
    return rng[0] if rng.ndim == 2 else rng


def run_step(state: Any) -> int:
    """The run's optimizer step count as an int (one host sync): the state's step, or member 0's for an
    ensemble (all members step together).

    Example:
        >>> import functrain as ft
        >>> run_step(ft.ensemble.create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1), n=3))
        0
    """
    return int(state.step.reshape(-1)[0])


def initialise(model: nn.Module, seed: int) -> nn.Module:
    """A deep copy of ``model`` re-initialised by ``reset_parameters()`` of each submodule, under
    ``torch.manual_seed(seed)`` (the caller's random state is left as it was).

    This is how :func:`create` initialises member ``i`` from ``seeds[i]``; train
    ``TrainState.create(initialise(model, seed), tx, seed=seed)`` alone to reproduce one member.

    Example:
        >>> a, b = initialise(torch.nn.Linear(3, 1), 0), initialise(torch.nn.Linear(3, 1), 0)
        >>> bool((a.weight == b.weight).all())
        True
    """
    fresh = copy.deepcopy(model)
    resettable = set()
    for name, module in fresh.named_modules():
        if callable(getattr(module, "reset_parameters", None)):
            resettable.add(name)
    for name, module in fresh.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and name not in resettable:
            raise ValueError(
                f"ensemble: submodule {name or '<root>'!r} ({type(module).__name__}) has parameters {own} but "
                "no reset_parameters(), so members cannot be re-initialised per seed; give it a "
                "reset_parameters() method, or pass share_init=True (all members start from the model's weights)"
            )
    devices = sorted({p.device.index or 0 for p in fresh.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for name, module in fresh.named_modules():
            if name in resettable:
                module.reset_parameters()
    return fresh


def _lengths(n: int | None, seeds: Sequence[int] | None, hyperparams: Mapping[str, Sequence[Any]]) -> int:
    sizes = {} if n is None else {"n": n}
    if seeds is not None:
        sizes["seeds"] = len(seeds)
    for name, values in hyperparams.items():
        if isinstance(values, torch.Tensor):
            if values.ndim != 1:
                raise ValueError(
                    f"ensemble.create: hyperparams[{name!r}] must be a 1-d tensor or a list (one value per "
                    f"member), got shape {tuple(values.shape)}"
                )
        elif not isinstance(values, Sequence) or isinstance(values, str):
            raise TypeError(
                f"ensemble.create: hyperparams[{name!r}] must be a list with one value per member, got "
                f"{type(values).__name__}"
            )
        sizes[f"hyperparams[{name!r}]"] = len(values)
    if not sizes:
        raise ValueError(
            "ensemble.create: give n=..., seeds=[...] or hyperparams={name: [one value per member]}"
        )
    if len(set(sizes.values())) != 1:
        raise ValueError(f"ensemble.create: the member counts disagree: {sizes}")
    count = next(iter(sizes.values()))
    if count < 1:
        raise ValueError(f"ensemble.create: an ensemble needs at least one member, got {sizes}")
    return count


def create(
    model: nn.Module,
    tx: GradientTransformation,
    *,
    n: int | None = None,
    seeds: Sequence[int] | None = None,
    hyperparams: Mapping[str, Sequence[float] | torch.Tensor] | None = None,
    share_init: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    loss_scale: Any = None,
    metrics: Any = None,
) -> TrainState:
    """A stacked state of ``n`` members that differ by initialisation, random key and hyperparameters.

    Args:
        model: the module; member ``i`` starts from ``initialise(model, seeds[i])`` (every submodule's
            ``reset_parameters()`` under ``torch.manual_seed(seeds[i])``), or from ``model``'s own weights
            for every member with ``share_init=True``.
        tx: the optimizer shared by all members (static, as for one model).
        n, seeds: the member count and the members' seeds (default ``0..n-1``); each member's random key
            is ``functrain.random.key(seeds[i])``. Give either or both (they must agree).
        hyperparams: per-member values of hyperparameters that live in the optimizer state, by the names
            ``functrain.optim.hyperparams`` reports (``learning_rate``, ``weight_decay``, ...), one per
            member: ``{"learning_rate": [1e-3, 3e-3]}``.
        device, dtype, loss_scale, metrics: as :meth:`TrainState.create`, for each member.

    Example:
        >>> import functrain as ft
        >>> state = create(torch.nn.Linear(4, 2), ft.optim.sgd(0.1), n=8)
        >>> state.step.shape, state.rng.shape
        (torch.Size([8]), torch.Size([8, 2]))
    """
    hyperparams = dict(hyperparams or {})
    count = _lengths(n, seeds, hyperparams)
    seeds = list(range(count)) if seeds is None else [int(s) for s in seeds]
    states = []
    for i, seed in enumerate(seeds):
        module = model if share_init else initialise(model, seed)
        state = TrainState.create(
            module, tx, seed=seed, device=device, dtype=dtype, loss_scale=loss_scale, metrics=metrics
        )
        if hyperparams:
            values = {k: v[i] for k, v in hyperparams.items()}
            state = state.replace(opt_state=optim.set_hyperparams(state.opt_state, **values))
        states.append(state)
    return stack(states)


def _check_same(states: Sequence[Any]) -> None:
    first = states[0]
    spec = tree.structure(first)
    for i, other in enumerate(states[1:], start=1):
        if tree.structure(other) != spec:
            raise ValueError(_structure_difference(first, other, i))
        for path, a, b in zip(tree.paths(first), tree.leaves(first), tree.leaves(other)):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                continue
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                raise ValueError(
                    f"ensemble.stack: leaf state.{path} differs between member 0 ({a.dtype} "
                    f"{list(a.shape)} on {a.device}) and member {i} ({b.dtype} {list(b.shape)} on {b.device}); "
                    "members must share shapes, dtypes and devices"
                )


def _structure_difference(a: Any, b: Any, i: int) -> str:
    pa, pb = tree.paths(a), tree.paths(b)
    only_a = [p for p in pa if p not in set(pb)][:5]
    only_b = [p for p in pb if p not in set(pa)][:5]
    if only_a or only_b:
        where = f"leaves only in member 0: {only_a}; only in member {i}: {only_b}"
    else:
        static = [
            f for f in ("tx", "tied", "non_persistent") if getattr(a, f, None) is not getattr(b, f, None)
        ]
        where = (
            f"the static fields {static} differ (members must share one optimizer object: set per-member "
            "values with hyperparams=..., not with separate optimizers)"
            if static
            else "the containers differ (types or keys)"
        )
    return f"ensemble.stack: member {i} does not have member 0's structure: {where}"


def stack(states: Sequence[Any]) -> Any:
    """Stack states of the same structure into one ensemble state (the inverse of :func:`members`).

    Example:
        >>> import functrain as ft
        >>> a = ft.TrainState.create(torch.nn.Linear(2, 1), tx := ft.optim.sgd(0.1), seed=0)
        >>> b = ft.TrainState.create(torch.nn.Linear(2, 1), tx, seed=1)
        >>> stack([a, b]).params["weight"].shape
        torch.Size([2, 1, 2])
    """
    states = list(states)
    if not states:
        raise ValueError("ensemble.stack: no states given")
    if any(is_ensemble(s) for s in states):
        raise ValueError("ensemble.stack: a state is already an ensemble; stack plain TrainStates")
    _check_same(states)
    return tree.map(lambda *xs: torch.stack(xs) if isinstance(xs[0], torch.Tensor) else xs[0], *states)


def member(state: Any, i: int) -> Any:
    """Member ``i`` of a stacked state as an ordinary state (own memory: checkpointable, ``state_dict()``-able).

    Example:
        >>> import functrain as ft
        >>> state = create(torch.nn.Linear(2, 1), ft.optim.sgd(0.1), n=3)
        >>> member(state, 2).step.shape
        torch.Size([])
    """
    n = size(state)
    if not isinstance(i, int) or isinstance(i, bool) or not -n <= i < n:
        raise IndexError(f"ensemble.member: index {i!r} out of range for {n} members")
    return tree.map(lambda x: x[i].clone() if isinstance(x, torch.Tensor) else x, state)


def members(state: Any) -> list[Any]:
    """Every member of a stacked state, in order (``stack(members(s))`` rebuilds ``s``)."""
    return [member(state, i) for i in range(size(state))]
