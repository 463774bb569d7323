"""Skipping steps whose gradients are not finite (inf or nan), without a host sync or a branch.

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = optim.skip_not_finite(optim.sgd(0.1))
    >>> state = tx.init({"w": torch.zeros(1)})
    >>> updates, state = tx.update({"w": torch.tensor([float("nan")])}, state)
    >>> updates["w"], int(state.total_notfinite)
    (tensor([0.]), 1)
"""

from __future__ import annotations

import torch

from functrain import tree
from functrain.optim._leaves import device_of
from functrain.optim.base import GradientTransformation, NormFn, OptState, update_with_norm
from functrain.tree import PyTree

__all__ = ["SkipNotFiniteState", "all_finite", "skip_not_finite"]


def all_finite(tree_: PyTree) -> torch.Tensor:
    """A 0-d bool tensor: True when every element of every tensor leaf is finite (True for no leaves).

    Example:
        >>> all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
        tensor(False)
    """
    tensors = [x for x in tree.leaves(tree_) if isinstance(x, torch.Tensor)]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(x).all() for x in tensors]).all()


@tree.struct
class SkipNotFiniteState:
    """State of :func:`skip_not_finite`.

    ``notfinite_count`` counts consecutive skipped steps (0 after a good step), ``total_notfinite`` all
    skipped steps, ``last_finite`` whether the last update was applied.
    """

    inner_state: OptState
    notfinite_count: torch.Tensor
    total_notfinite: torch.Tensor
    last_finite: torch.Tensor


def skip_not_finite(inner: GradientTransformation) -> GradientTransformation:
    """Run ``inner``, but where any incoming update is inf/nan, return zero updates and keep ``inner``'s old state.

    The choice is made with ``torch.where``, so there is no host sync and no recompile. A skipped step
    does not advance ``inner``'s counts (its schedules and bias corrections see only applied steps), as in
    ``optax.apply_if_finite``.

    Example:
        >>> from functrain import optim
        >>> tx = skip_not_finite(optim.adam(1e-3))
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> _, state = tx.update({"w": torch.tensor([float("inf")])}, state)
        >>> int(state.notfinite_count), int(state.inner_state[0].count)
        (1, 0)
    """

    def init(params: PyTree) -> SkipNotFiniteState:
        zero = torch.zeros((), dtype=torch.int64, device=device_of(params))
        return SkipNotFiniteState(
            inner_state=inner.init(params),
            notfinite_count=zero,
            total_notfinite=zero.clone(),
            last_finite=torch.ones((), dtype=torch.bool, device=zero.device),
        )

    def update(
        updates: PyTree,
        state: SkipNotFiniteState,
        params: PyTree | None = None,
        *,
        norm: NormFn | None = None,
    ) -> tuple[PyTree, SkipNotFiniteState]:
        finite = all_finite(updates).to(state.notfinite_count.device)
        new_updates, new_inner = update_with_norm(inner, updates, state.inner_state, params, norm)
        new_updates = tree.map(lambda u: torch.where(finite, u, torch.zeros_like(u)), new_updates)
        inner_state = tree.keep_where(finite, new_inner, state.inner_state)
        not_finite = (~finite).to(torch.int64)
        return new_updates, SkipNotFiniteState(
            inner_state=inner_state,
            notfinite_count=(state.notfinite_count + 1) * not_finite,
            total_notfinite=state.total_notfinite + not_finite,
            last_finite=finite,
        )

    return GradientTransformation(init, update)
