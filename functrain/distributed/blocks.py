"""ZeRO-3 with blocks: each block's params are all-gathered inside its forward and again in the backward.

``fully_shard(level="params", blocks=...)`` names the model's repeated blocks (a transformer's layers).
Inside a sharded train step each block then runs as a rematerialised function (:func:`functrain.remat`)
of its *shards*: the forward all-gathers the block's params, runs the block and frees them, keeping only
the block's input; the backward gathers them again, recomputes the block, and the gather's own backward
(a reduce-scatter) leaves each rank the sum over ranks of its rows of the gradient. So at any moment one
block's full params (and one block's activations in the backward) are alive, not the whole model's: the
memory profile of ZeRO-3 (FSDP's per-block units with reshard after forward), for one more forward of
each block. Params outside the blocks (embeddings, head) are gathered once for the whole step, as
without blocks.

A model without blocks (``blocks=None``, or none found) gets ZeRO-3's savings at rest (params and
optimizer state 1/world per rank) but not during the step: the full params and gradients are alive
through its forward and backward.

What a block may not do: update buffers in training (BatchNorm inside a block would update its
statistics twice: keep it outside the blocks), share a parameter with another block or with the rest
of the model, or draw random numbers in a compiled step (dropout: :class:`functrain.remat.
RematRandomnessError`; eagerly the generator state is replayed).

Which submodules are blocks (``fully_shard(blocks=...)``) is :mod:`functrain.distributed.block_spec`.

Example:
    >>> import torch
    >>> from functrain import distributed
    >>> model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    >>> GatheredBlocks(model, "auto", distributed.fully_shard()).names
    ('0', '1')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from functrain.core.variables import model_variables
from functrain.distributed.block_spec import Blocks, block_names
from functrain.distributed.sharding import Sharding, ShardLayout
from functrain.remat import Remat, _Holder

__all__ = ["GatheredBlocks"]


class GatheredBlocks:
    """The blocks of one model, each with a forward that gathers its params (see the module doc);
    made once by the sharded step. Each block's ``forward`` becomes a dispatcher that runs the gathering
    forward within ``active()`` (a step's forward and backward) and the block's own forward otherwise
    (evaluation, another step).

    Example:
        >>> import torch
        >>> from functrain import distributed
        >>> model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        >>> sorted(GatheredBlocks(model, "auto", distributed.fully_shard()).params)
        ['0.bias', '0.weight', '1.bias', '1.weight']
    """

    def __init__(self, model: nn.Module, blocks: Blocks, sharding: Sharding) -> None:
        params, _, tied, _ = model_variables(model, copy=False)
        self.names = block_names(model, blocks)
        owner = {name: b for b in self.names for name in params if name.startswith(b + ".")}
        for alias, name in tied:
            if name in params and owner.get(alias) != owner.get(name):
                raise ValueError(
                    f"fully_shard(blocks=...): the parameter {name!r} is shared with {alias!r} across a "
                    "block's boundary, but a block's params are gathered inside its forward only: make "
                    "the module holding both the block, or leave them out of the blocks"
                )
        self.params = frozenset(owner)
        self.on = False  # True while a step's forward and backward run (``active()``)
        layout = ShardLayout(sharding, tuple((n, tuple(p.shape)) for n, p in params.items()))
        for b in self.names:
            module = model.get_submodule(b)
            forward = module.__dict__.get("forward")
            if not isinstance(forward, _BlockForward):
                forward = module.forward = _BlockForward(module.forward)
            forward.routes.append((self, self._gathered_forward(module, b, layout, forward.inner)))

    def __bool__(self) -> bool:
        return bool(self.names)

    def _gathered_forward(self, module: nn.Module, block: str, layout: Any, inner: Any) -> Any:
        """``module``'s forward, rematerialised, on its params all-gathered from the shards the step
        put in its slots."""
        for sub in module.modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"fully_shard(blocks=...): the block {block!r} holds a BatchNorm, whose statistics its "
                    "recomputation would update twice: leave it outside the blocks"
                )
        slots = [
            (sub, attr, f"{block}.{prefix}.{attr}" if prefix else f"{block}.{attr}")
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for attr in sub._parameters
        ]
        slots = [(sub, attr, name) for sub, attr, name in slots if name in self.params]
        shapes = {name: layout.global_shape(name) for _, _, name in slots}
        inner = inner.fn if isinstance(inner, Remat) else inner  # already ft.remat'ed: recompute once
        dtype = layout.request.param_dtype
        holder = _Holder([module])  # functional_call of the block's own forward (not this one)
        local = {name: "held.0." + name[len(block) + 1 :] for _, _, name in slots}

        def gathered_forward(*args: Any, **kwargs: Any) -> Any:
            # the slots hold this rank's shards (put there by the step's bind, or by remat's recompute);
            # functional_call puts the gathered params in for the call (dynamo refuses a plain
            # assignment to the slots inside the rematerialised block)
            shards = {name: sub._parameters[attr] for sub, attr, name in slots}
            full = layout.gather(shards, shapes=shapes, differentiable=True)
            tensors = {local[n]: t if dtype is None else t.to(dtype) for n, t in full.items()}
            return torch.func.functional_call(holder, tensors, (inner, args, kwargs), strict=False)

        wrapper = Remat(gathered_forward)
        if not any(m is module for m in wrapper._holder.held):  # inner was not the module's own method
            wrapper._holder = _Holder([module, *wrapper._holder.held])
        # remat differentiates with respect to the tensors of the modules it holds: the block's shards
        return wrapper

    def active(self) -> _Switch:
        """A context in which every block's forward gathers its params."""
        return _Switch(self)

    def split(self, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(the blocks' params, the others)``."""
        inside = {k: v for k, v in params.items() if k in self.params}
        return inside, {k: v for k, v in params.items() if k not in self.params}


class _BlockForward:
    """A block's ``forward`` (set on the module by the sharded step): its own forward, or, while a
    step's :class:`GatheredBlocks` is on, that step's gathering forward."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.routes: list[tuple[GatheredBlocks, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for blocks, gathered in self.routes:
            if blocks.on:
                return gathered(*args, **kwargs)
        return self.inner(*args, **kwargs)


class _Switch:
    """Turns a :class:`GatheredBlocks` on for a block of code (plain code: dynamo traces it)."""

    def __init__(self, blocks: GatheredBlocks) -> None:
        self.blocks = blocks

    def __enter__(self) -> None:
        self.blocks.on = True

    def __exit__(self, *exc: Any) -> None:
        self.blocks.on = False
