"""Betas kept in the optimizer state as settable, differentiable hyperparameters (opt-in).

By default Adam's and Lion's ``b1``/``b2`` are Python floats closed over by the transform (constants in a
compiled graph). ``betas_in_state=True`` (on :func:`functrain.optim.adam`, ``adamw``, ``lion``, ``lamb``,
``scale_by_adam``, ``scale_by_lion``) keeps them as 0-d tensors in a :class:`BetasState` around the
transform's own state, in the hyperparameters' dtype (float32, or float64 for float64 params: a float32
state holds the float32-rounded betas). :func:`functrain.optim.hyperparams` then lists ``b1`` and ``b2``,
:func:`functrain.optim.set_hyperparams` sets them (a tensor keeps its autograd history), and the update
reads them as tensors, so ``torch.func.grad`` of a loss after unrolled steps w.r.t. the betas is their
hypergradient. Adam with betas in the state runs the in-graph update (torch's fused kernel takes floats).

Example:
    >>> import torch
    >>> from functrain import optim
    >>> state = optim.adam(1e-3, betas_in_state=True).init({"w": torch.zeros(2)})
    >>> sorted(optim.hyperparams(state))
    ['b1', 'b2', 'learning_rate']
    >>> float(optim.hyperparams(optim.set_hyperparams(state, b2=0.99))["b2"])
    0.9900000095367432
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from functrain import tree
from functrain.optim._leaves import scalar
from functrain.optim.base import GradientTransformation, OptState
from functrain.optim.hyperparams import hyperparam_field
from functrain.tree import PyTree

__all__ = ["BetasState", "with_betas_in_state"]

Beta = float | torch.Tensor
UpdateWithBetas = Callable[[PyTree, Any, PyTree | None, Beta, Beta], tuple[PyTree, Any]]


@tree.struct
class BetasState:
    """The transform's own state (``inner``) and its settable betas ``b1``, ``b2`` (0-d tensors)."""

    inner: OptState
    b1: torch.Tensor = hyperparam_field()
    b2: torch.Tensor = hyperparam_field()


def with_betas_in_state(
    init: Callable[[PyTree], OptState], update: UpdateWithBetas, b1: float, b2: float
) -> GradientTransformation:
    """A transform whose betas live in its state: ``update(updates, inner, params, b1, b2)`` is called with
    the state's 0-d tensors (it must use them as tensors, never ``float()`` them: that drops the gradient).

    Example:
        >>> from functrain.optim.transforms import ScaleByLionState
        >>> tx = with_betas_in_state(
        ...     lambda p: ScaleByLionState(mu=tree.zeros_like(p)),
        ...     lambda u, s, p, b1, b2: (tree.map(lambda g: g * b1, u), s),
        ...     0.5,
        ...     0.9,
        ... )
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.zeros(1)}))[0]
        {'w': tensor([0.5000])}
    """

    def init_state(params: PyTree) -> BetasState:
        return BetasState(inner=init(params), b1=scalar(b1, params), b2=scalar(b2, params))

    def update_state(
        updates: PyTree, state: BetasState, params: PyTree | None = None
    ) -> tuple[PyTree, BetasState]:
        out, inner = update(updates, state.inner, params, state.b1, state.b2)
        return out, state.replace(inner=inner)

    return GradientTransformation(init_state, update_state)
