"""Clipping updates: by value (:func:`clip`) and by the global norm (:func:`clip_by_global_norm`).

Example:
    >>> import torch
    >>> from functrain import optim
    >>> tx = optim.clip_by_global_norm(1.0)
    >>> tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init({}))[0]["b"]
    tensor([0.8000])
"""

from __future__ import annotations

import torch

from functrain import tree
from functrain.core import foreach
from functrain.optim._leaves import check_nonnegative
from functrain.optim.base import EmptyState, GradientTransformation, NormFn, stateless_leafwise
from functrain.tree import PyTree

__all__ = ["clip", "clip_by_global_norm"]


def clip(max_delta: float) -> GradientTransformation:
    """Clamp every update element to ``[-max_delta, max_delta]`` (``torch.nn.utils.clip_grad_value_``).

    Example:
        >>> clip(1.0).update({"w": torch.tensor([-3.0, 0.5])}, clip(1.0).init({}))[0]
        {'w': tensor([-1.0000,  0.5000])}
    """
    max_delta = check_nonnegative("clip", "max_delta", max_delta)

    def clamp(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        clipped = foreach.clamp_min(leaves, -max_delta)
        foreach.clamp_max_(clipped, max_delta)
        return clipped

    return stateless_leafwise(clamp)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so their global L2 norm is at most ``max_norm``.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_``: the factor is
    ``min(1, max_norm / (norm + 1e-6))``, applied without a branch (a non-finite norm gives non-finite
    updates, which :func:`functrain.optim.skip_not_finite` can catch). ``update(..., norm=fn)`` takes the
    leaves' norms with ``fn`` (a sharded step's are over all ranks' rows; :data:`functrain.optim.NormFn`).

    Example:
        >>> clip_by_global_norm(1.0).update({"w": torch.tensor([0.0, 2.0])}, clip_by_global_norm(1.0).init({}))[0]
        {'w': tensor([0.0000, 1.0000])}
    """
    max_norm = check_nonnegative("clip_by_global_norm", "max_norm", max_norm)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(
        updates: PyTree, state: EmptyState, params: PyTree | None = None, *, norm: NormFn | None = None
    ) -> tuple[PyTree, EmptyState]:
        leaves, spec = tree.flatten(updates)
        if not leaves:
            return updates, state
        factor = torch.clamp(max_norm / (tree.global_norm(leaves, norm) + 1e-6), max=1.0)
        return tree.unflatten(spec, foreach.mul(leaves, factor)), state

    return GradientTransformation(init, update)
