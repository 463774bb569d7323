"""The parallel strategy a train step is given: how its state is laid out over processes, and what the
step's stages ask of that layout.

A strategy answers, for the stages of :func:`functrain.make_train_step`:

- ``params_for_grad(state)``: the params the forward and backward run on (gathered, for ZeRO-3);
- ``loss_factor(share, examples)`` and ``micro_grads(state, grads, examples)``: how a micro-batch's loss
  and gradient are weighted and (ZeRO-2/3) reduce-scattered as they are made;
- ``reduce(state, grads, loss, metrics, buffers, examples)``: the one reduction protocol, the step's
  gradients, loss, metrics and buffers combined over the processes (example-weighted);
- ``norm``: the per-leaf norm function (:data:`functrain.optim.NormFn`) that clipping, ``grad_norm`` and
  LAMB take, passed to the optimizer as an argument (``apply_gradients(..., norm=strategy.norm)``), never
  set as a global: ``None`` where each leaf is whole on this process;
- ``opt_params(state)`` and ``params_at_rest(state, params)``: the rows the optimizer updates, and the
  updated rows as the state keeps them.

Four strategies: :class:`Replicated` (one process, or an ensemble's members under vmap, which needs
nothing more: ``functrain.core.foreach`` sees vmap's batched tensors), :class:`DataParallel` (replicated
params, the gradient all-reduce of :class:`~functrain.distributed.GradientReducer`) and
``functrain.distributed.sharded_step.ShardedStep`` (ZeRO-1/2/3, with or without blocks) and
``functrain.distributed.tensor_parallel.TensorParallel`` (params as DTensors split by a plan).

Example:
    >>> import torch
    >>> strategy = Replicated()
    >>> grads, loss, metrics, buffers = strategy.reduce(None, {"w": torch.ones(1)}, torch.ones(()), {}, {}, 4)
    >>> grads
    {'w': tensor([1.])}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["DataParallel", "Examples", "Reduced", "Replicated"]

Examples = int | torch.Tensor
"""A process's examples in a step: the batch's rows, or a padded batch's real rows (a 0-d tensor)."""

Reduced = tuple[Any, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""``(grads, loss, metrics, buffers)`` after :meth:`Replicated.reduce`."""


class Replicated:
    """Every leaf whole on this process and nothing to combine: one process (the default).

    Example:
        >>> Replicated().counts_examples, Replicated().norm is None
        (False, True)
    """

    reducer: Callable[..., Reduced] | None = None  # what StepSpec.gradient_reducer reports
    norm = None  # each leaf is whole here: its own norm
    # whether ``reduce`` reads the step's example count (a padded batch's costs an op on its mask)
    counts_examples = False

    def params_for_grad(self, state: Any) -> Mapping[str, torch.Tensor]:
        """The params the forward and backward run on."""
        return state.params

    def params_whole(self, state: Any) -> Mapping[str, torch.Tensor]:
        """The whole params, for an eager forward outside the gradient (``settle``)."""
        return state.params

    def gathering(self) -> contextlib.AbstractContextManager[Any]:
        """What the forward and backward run within (ZeRO-3 blocks gather there)."""
        return contextlib.nullcontext()

    def loss_factor(self, share: float, examples: Examples | None) -> float | torch.Tensor | None:
        """What a micro-batch's loss is multiplied by before its backward, where the gradient is reduced
        inside the backward (ZeRO-3 blocks); ``None``: the gradient is weighted by ``share`` after it."""
        return None

    def micro_grads(self, state: Any, grads: Any, examples: Examples | None) -> Any:
        """A micro-batch's (weighted) gradients, as they are summed over the micro-batches."""
        return grads

    def reduce(
        self,
        state: Any,
        grads: Any,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        examples: Examples | None,
    ) -> Reduced:
        """The step's gradients, loss, metrics and buffers combined over the processes; ``examples`` is
        this process's (read where :attr:`counts_examples`)."""
        return grads, loss, dict(metrics), dict(buffers)

    def opt_params(self, state: Any) -> Mapping[str, torch.Tensor]:
        """The params the optimizer updates (this process's rows)."""
        return state.params

    def params_at_rest(self, state: Any, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The updated params as the state keeps them."""
        return params


class DataParallel(Replicated):
    """Replicated params; the step's results all-reduced, example-weighted, by ``reducer`` (a
    :class:`~functrain.distributed.GradientReducer`, or any function of the same protocol as
    :meth:`Replicated.reduce`).

    Example:
        >>> from functrain.distributed import gradient_reducer
        >>> DataParallel(gradient_reducer()).reducer.world_size
        1
    """

    counts_examples = True

    def __init__(self, reducer: Callable[..., Reduced]) -> None:
        self.reducer = reducer  # type: ignore[assignment]

    def reduce(
        self,
        state: Any,
        grads: Any,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        examples: Examples | None,
    ) -> Reduced:
        return self.reducer(state, grads, loss, metrics, buffers, examples)  # type: ignore[misc]
