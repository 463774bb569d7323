"""Data parallelism inside the step: the example-weighted gradient all-reduce, as one traced collective.

Every rank computes the mean loss and gradient of *its* batch. Ranks can hold different numbers of
examples (the final step of an epoch spreads the remainder; a rank's batch may be empty), so a plain
average of the ranks' gradients would over-weight the small batches. The reducer instead sums
``grad_r * n_r`` over ranks and divides by ``sum(n_r)``: exactly the gradient of the mean loss over the
global batch, as one process with the whole batch would compute it. The loss and the loss function's
extra metrics are combined the same way, so what the step reports is the global example-weighted mean.

All of it — gradients, loss, metrics and (optionally) buffer updates — is packed into one flat float32
buffer and reduced with a single ``torch.distributed._functional_collectives.all_reduce``, which
``torch.compile`` traces into the step's graph (no graph break, no host sync).

Example:
    >>> import torch, functrain as ft
    >>> from functrain import distributed
    >>> model = torch.nn.Linear(4, 2)
    >>> reducer = distributed.gradient_reducer(model=model)  # no process group: a no-op
    >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy),
    ...                           gradient_reducer=reducer)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from functrain import tree
from functrain.distributed.env import is_distributed

__all__ = ["GradientReducer", "gradient_reducer"]

BufferMode = Literal["mean", "local"]


class GradientReducer:
    """The hook ``make_train_step(..., gradient_reducer=...)`` calls once per step, after the backward.

    ``reducer(state, grads, loss, metrics, buffers, examples) -> (grads, loss, metrics, buffers)``, the
    reduction protocol of every parallel strategy (:mod:`functrain.distributed.strategy`): ``grads``,
    ``loss`` and ``metrics`` are this rank's means over its ``examples``, ``buffers`` its updated buffers
    (``state.buffers`` the old ones); the results are the means over all ranks' examples.

    Buffers (BatchNorm running statistics) follow ``buffers``:

    - ``"mean"``: each rank's update ``new - old`` is averaged, weighted by its examples, and applied to
      the (replicated) old value, so every rank keeps the same buffers; an unchanged buffer stays
      bit-identical. Integer buffers (``num_batches_tracked``) take the maximum over ranks.
    - ``"local"``: every rank keeps its own statistics (as PyTorch DDP without SyncBatchNorm does after
      its initial broadcast); checkpoints then hold rank 0's.

    Either way, a rank whose batch is empty keeps its buffers and contributes nothing (no NaN).

    ``model``: only its registered buffers are averaged. Without it every floating tensor in
    ``state.buffers`` is, including frozen (``requires_grad=False``) parameters, which functrain keeps
    there: correct, but a wasted all-reduce of the frozen weights each step.

    The process group is looked up when the reducer is made: make it after :func:`initialize`. Without a
    process group of more than one process it returns its inputs unchanged, unless ``group`` is given.

    Example:
        >>> reducer = GradientReducer(buffers="local")
        >>> reducer.world_size
        1
    """

    def __init__(
        self,
        *,
        buffers: BufferMode = "mean",
        model: nn.Module | None = None,
        group: Any = None,
    ) -> None:
        if buffers not in ("mean", "local"):
            raise ValueError(f"gradient_reducer: buffers must be 'mean' or 'local', got {buffers!r}")
        self.buffers = buffers
        self.buffer_names = (
            None
            if model is None
            else frozenset(name for name, b in model.named_buffers(remove_duplicate=False) if b is not None)
        )
        # An explicit group is reduced over even when it has one process (benchmarks time the path so).
        self.active = group is not None or is_distributed()
        self.group = (group or dist.group.WORLD) if self.active else None
        self.world_size = dist.get_world_size(self.group) if self.active else 1

    def _averaged(self, name: str, value: torch.Tensor) -> bool:
        if self.buffers != "mean" or not value.is_floating_point():
            return False
        return self.buffer_names is None or name in self.buffer_names

    def __call__(
        self,
        state: Any,
        grads: Any,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        examples: int | torch.Tensor,
    ) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.combine(grads, loss, metrics, buffers, state.buffers, examples)[:4]

    def combine(
        self,
        grads: Any,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        old_buffers: Mapping[str, torch.Tensor],
        num_examples: int,
    ) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """What calling the reducer does, given the old buffers themselves, plus the global example count
        (a 0-d float32 tensor, at least 1), by which a sharded step divides its reduce-scattered
        ``grad * n`` sums."""
        if not self.active:
            n = torch.scalar_tensor(max(num_examples, 1), dtype=torch.float32, device=loss.device)
            return grads, loss, dict(metrics), dict(buffers), n
        import torch.distributed._functional_collectives as funcol

        device = loss.device
        # a padded batch (functrain.data.padding) counts its real rows: a 0-d tensor
        n = torch.as_tensor(num_examples, dtype=torch.float32, device=device).reshape(())
        has = n > 0

        def weighted(x: torch.Tensor) -> torch.Tensor:
            # torch.where, not a multiplication by zero: an empty batch's loss and grads may be NaN.
            return torch.where(has, x.detach().float() * n, torch.zeros((), device=device)).reshape(-1)

        grad_leaves, grad_spec = tree.flatten(grads)
        metric_names = sorted(metrics)
        # A rank whose batch is empty keeps its buffers: BatchNorm on zero examples writes NaN statistics.
        buffers = {
            k: torch.where(has, v, old_buffers[k]) if k in old_buffers else v for k, v in buffers.items()
        }
        averaged = [k for k in sorted(buffers) if k in old_buffers and self._averaged(k, buffers[k])]
        pieces = [weighted(g) for g in grad_leaves]
        pieces.append(weighted(loss))
        pieces += [weighted(metrics[k]) for k in metric_names]
        pieces += [weighted(buffers[k] - old_buffers[k]) for k in averaged]
        pieces.append(n.reshape(1))
        summed = funcol.all_reduce(torch.cat(pieces), "sum", self.group)
        # Every step holds at least one example somewhere; the clamp only keeps a pathological all-empty
        # step at zero instead of NaN.
        total = summed[-1].clamp_min(1.0)

        sizes = [g.numel() for g in grad_leaves] + [1] + [1] * len(metric_names)
        sizes += [buffers[k].numel() for k in averaged] + [1]
        parts = iter(torch.split(summed, sizes))
        new_grads = [(next(parts) / total).reshape(g.shape).to(g.dtype) for g in grad_leaves]
        new_loss = (next(parts) / total).reshape(()).to(loss.dtype)
        new_metrics = {k: (next(parts) / total).reshape(()).to(metrics[k].dtype) for k in metric_names}
        new_buffers = dict(buffers)
        for k in averaged:
            old = old_buffers[k]
            new_buffers[k] = (old.float() + (next(parts) / total).reshape(old.shape)).to(old.dtype)
        if self.buffers == "mean":
            counters = [k for k in sorted(buffers) if self._integer_counter(k, buffers[k])]
            if counters:
                stacked = torch.stack([buffers[k].reshape(-1).to(torch.int64) for k in counters])
                maxed = funcol.all_reduce(stacked, "max", self.group)
                for i, k in enumerate(counters):
                    new_buffers[k] = maxed[i].reshape(buffers[k].shape).to(buffers[k].dtype)
        return tree.unflatten(grad_spec, new_grads), new_loss, new_metrics, new_buffers, total

    def _integer_counter(self, name: str, value: torch.Tensor) -> bool:
        # One-element integer buffers are counters (num_batches_tracked); larger ones (index tables)
        # are left alone.
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.numel() != 1:
            return False
        return self.buffer_names is None or name in self.buffer_names

    def __repr__(self) -> str:
        return f"GradientReducer(world_size={self.world_size}, buffers={self.buffers!r})"


def gradient_reducer(
    *, buffers: BufferMode = "mean", model: nn.Module | None = None, group: Any = None
) -> GradientReducer:
    """The data-parallel hook for ``make_train_step(..., gradient_reducer=...)`` (see :class:`GradientReducer`).

    Example:
        >>> import torch, functrain as ft
        >>> env = initialize()  # under torchrun, before the reducer is made  # doctest: +SKIP
        >>> model = torch.nn.Linear(4, 2)
        >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> step = ft.make_train_step(model, loss_fn, gradient_reducer=gradient_reducer(model=model))
        >>> step.gradient_reducer  # one process here: a world of one
        GradientReducer(world_size=1, buffers='mean')
    """
    return GradientReducer(buffers=buffers, model=model, group=group)
