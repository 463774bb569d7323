"""The ZeRO strategy: what ``make_train_step(..., sharding=...)`` does differently from a replicated step,
as the methods of a parallel strategy (:mod:`functrain.distributed.strategy`).

Per step, inside the one compiled graph (all collectives are functional, traced by ``torch.compile``):

1. ZeRO-3: all-gather the param shards (in ``param_dtype`` if set) *outside* the differentiated
   function; ``grad_and_value`` then runs over the full params, exactly as without sharding. With
   blocks (``fully_shard(blocks=...)``) only the params outside the blocks are gathered here; each
   block's forward gathers its own inside the differentiated function, rematerialised, and the gather's
   backward reduce-scatters its gradient (:mod:`functrain.distributed.blocks`), so the loss is
   weighted by ``n_r`` before the backward instead of the gradient after it.
2. Reduce-scatter ``grad * n_r`` (``n_r``: this rank's examples; an empty batch contributes zeros) in the
   params' own dtype: after every micro-batch (ZeRO-2/3) or once per step (ZeRO-1). One all-reduce
   carries loss, metrics, BatchNorm buffer updates and ``n_r``; the gradient shard is divided by the
   global ``N``: the step equals one process on the union of the ranks' batches.
3. The optimizer runs on this rank's rows (``ShardLayout.local``) with every norm global: the step
   passes :attr:`ShardedStep.norm` to it as an argument (``apply_gradients(..., norm=)``; clipping,
   ``grad_norm`` and LAMB's trust ratio all-reduce the squares of the local norms; no global setting);
   ZeRO-1/2 all-gather the new rows into the replicated params.

Without blocks the full params are alive during the whole step (forward and backward): params and
optimizer state are sharded at rest, the step's peak holds the full params and gradients; with blocks,
one block's params at a time (see ``DESIGN_FSDP.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from functrain.distributed.blocks import GatheredBlocks
from functrain.distributed.gradients import GradientReducer
from functrain.distributed.sharding import Sharding, ShardLayout
from functrain.distributed.strategy import Examples, Reduced, Replicated

__all__ = ["ShardedStep", "global_norm_fn", "weigh_grads"]


def global_norm_fn(sharding: Sharding) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
    """The per-leaf norms of all ranks' rows (``functrain.optim.NormFn``) for leaves sharded as
    ``sharding``; ``None`` on one rank (each leaf is whole)."""
    return ShardLayout(sharding, ()).norm_fn()


class ShardedStep(Replicated):
    """The ZeRO strategy; made once by ``make_train_step`` (not part of the public API).

    Example:
        >>> from functrain import distributed
        >>> plan = ShardedStep(distributed.fully_shard(level="grads"), model=None)
        >>> plan.request.zero_stage
        2
    """

    def __init__(
        self,
        sharding: Sharding,
        *,
        model: nn.Module | None,
        gradient_reducer: Any = None,
        precision_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(sharding, Sharding):
            raise TypeError(
                "make_train_step: sharding must come from functrain.distributed.fully_shard(...), got "
                f"{type(sharding).__name__}"
            )
        if gradient_reducer is not None:
            raise ValueError(
                "make_train_step: pass sharding= or gradient_reducer=, not both (a sharded step reduces "
                "its own gradients, loss, metrics and buffers)"
            )
        if precision_dtype == torch.float16:
            raise ValueError(
                "make_train_step: precision='fp16' is not supported with sharding (its overflow check "
                "would be per rank); use precision='bf16' or fully_shard(param_dtype=torch.bfloat16)"
            )
        self.request = sharding
        group = sharding.group if sharding.world_size > 1 else None
        self.reducer = GradientReducer(buffers=sharding.buffers, model=model, group=group)
        self.norm = global_norm_fn(sharding)
        self.blocks: GatheredBlocks | None = None
        if sharding.blocks is not None:
            if model is None:
                raise ValueError(
                    "make_train_step: fully_shard(blocks=...) needs the model as an nn.Module (its blocks "
                    "are submodules), got an apply function"
                )
            blocks = GatheredBlocks(model, sharding.blocks, sharding)
            self.blocks = blocks if blocks else None  # none found: the whole model gathered, as without

    def layout(self, state: Any) -> ShardLayout:
        """The state's layout, checked against this step's request."""
        layout = getattr(state, "layout", None)
        if not isinstance(layout, ShardLayout):
            raise ValueError(
                "make_train_step(sharding=...) got a state that is not sharded: create it with "
                "TrainState.create(model, tx, sharding=<the same fully_shard(...)>)"
            )
        s, mine = layout.request, self.request
        if s is not mine and (s.level, s.rank, s.world_size) != (mine.level, mine.rank, mine.world_size):
            raise ValueError(
                f"the state is sharded as {s!r} but the step as {mine!r}: pass the same fully_shard(...) "
                "to TrainState.create and make_train_step"
            )
        return layout

    def params_for_grad(self, state: Any) -> dict[str, torch.Tensor]:
        """The params the forward and backward run on: whole (gathered for ZeRO-3), except the blocks'
        params, passed as shards (their forwards gather them)."""
        if self.blocks is None:
            return self.params_whole(state)
        inside, outside = self.blocks.split(state.params)
        gathered = {**self.layout(state).gather(outside, self.request.param_dtype), **inside}
        return {k: gathered[k] for k in state.params}

    def params_whole(self, state: Any) -> dict[str, torch.Tensor]:
        """The full params (gathered for ZeRO-3), in ``param_dtype`` if set."""
        layout, dtype = self.layout(state), self.request.param_dtype
        if self.request.shards_params:
            return layout.gather(state.params, dtype)
        return dict(state.params) if dtype is None else {k: v.to(dtype) for k, v in state.params.items()}

    def gathering(self) -> contextlib.AbstractContextManager[Any]:
        """Within this block the blocks' forwards gather their params (nothing to do without blocks)."""
        return contextlib.nullcontext() if self.blocks is None else self.blocks.active()

    counts_examples = True

    def loss_factor(self, share: float, examples: Examples | None) -> float | torch.Tensor | None:
        """With blocks, what the micro-batch's loss is multiplied by before the backward (its share of
        the step times this rank's examples: the gradients are reduced inside the backward); None
        without blocks (the gradient is weighted after the backward)."""
        return None if self.blocks is None or examples is None else share * examples

    def _scatter(
        self, state: Any, grads: Mapping[str, torch.Tensor], n: Examples, weighted: bool = False
    ) -> dict[str, torch.Tensor]:
        master = {k: v.dtype for k, v in state.params.items()}
        # with blocks the loss was already weighted by n
        factor = 1 if weighted else n
        return self.layout(state).reduce_scatter(weigh_grads(grads, master, n, factor), master)

    def micro_grads(self, state: Any, grads: Any, examples: Examples | None) -> Any:
        """A micro-batch's gradients: reduce-scattered at once (ZeRO-2/3) or kept whole (ZeRO-1). With
        blocks the loss was weighted (:meth:`loss_factor`) and the blocks' gradients are already this
        rank's rows of the sum over ranks."""
        assert examples is not None  # counts_examples
        n = examples
        if self.request.level == "optimizer":
            return grads
        if self.blocks is None:
            return self._scatter(state, grads, n)
        inside, outside = self.blocks.split(grads)
        master = {k: state.params[k].dtype for k in inside}
        out = {
            **self._scatter(state, outside, n, weighted=True),
            **{k: g.to(master[k]) for k, g in inside.items()},
        }
        return {k: out[k] for k in grads}

    def reduce(
        self,
        state: Any,
        grads: Any,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        examples: Examples | None,
    ) -> Reduced:
        """This rank's rows of the global-mean gradient, and the global loss, metrics and buffers."""
        assert examples is not None  # counts_examples
        n = examples
        if self.request.level == "optimizer":
            grads = self._scatter(state, grads, n)
        _, loss, metrics, buffers, total = self.reducer.combine({}, loss, metrics, buffers, state.buffers, n)
        # in place: the reduced shards are the step's own new tensors (a copy would hold a second
        # gradient's worth of memory at the step's peak)
        return {k: g.div_(total.to(g.dtype)) for k, g in grads.items()}, loss, metrics, buffers

    def opt_params(self, state: Any) -> dict[str, torch.Tensor]:
        """The rows the optimizer updates."""
        return self.layout(state).local(state.params)

    def params_at_rest(self, state: Any, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The updated rows as the state keeps its params."""
        return self.layout(state).at_rest(params)


def weigh_grads(
    grads: Mapping[str, torch.Tensor],
    master: Mapping[str, torch.dtype],
    examples: Examples,
    factor: Examples | None = None,
) -> dict[str, torch.Tensor]:
    """``grad * factor`` (default: ``examples``) in the ``master`` dtypes, the summands of a
    reduce-scatter; zeros for an empty batch (its loss and gradients may be NaN; a padded batch's real
    rows, a tensor, may be 0, but its masked loss is finite).

    Example:
        >>> weigh_grads({"w": torch.ones(2)}, {"w": torch.float64}, 3)
        {'w': tensor([3., 3.], dtype=torch.float64)}
    """
    if isinstance(examples, int) and examples == 0:
        return {k: torch.zeros_like(g, dtype=master[k]) for k, g in grads.items()}
    factor = examples if factor is None else factor
    return {k: g.to(master[k]) * factor for k, g in grads.items()}
