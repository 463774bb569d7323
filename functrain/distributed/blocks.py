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
from functrain.remat import Remat

__all__ = ["GatheredBlocks"]


class GatheredBlocks:
    """The blocks of one model, each with a forward that gathers its params (see the module doc);
    made once by the sharded step. Within ``active()`` (a step's forward and backward) each block's
    ``forward`` is its gathering forward; outside it (evaluation, another step, after the step) the
    model is as it was: nothing is left set on it.

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
        layout = ShardLayout(sharding, tuple((n, tuple(p.shape)) for n, p in params.items()))
        # (block, its gathering forward): set as the block's ``forward`` within ``active()`` only
        self.forwards: tuple[tuple[nn.Module, Remat], ...] = tuple(
            (module, self._gathered_forward(module, b, layout))
            for b in self.names
            for module in [model.get_submodule(b)]
        )

    def __bool__(self) -> bool:
        return bool(self.names)

    def _gathered_forward(self, module: nn.Module, block: str, layout: ShardLayout) -> Remat:
        """``module``'s forward, rematerialised, on its params all-gathered from the shards the step
        put in its slots."""
        for sub in module.modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                raise ValueError(
                    f"fully_shard(blocks=...): the block {block!r} holds a BatchNorm, whose statistics its "
                    "recomputation would update twice: leave it outside the blocks"
                )
        # remat differentiates with respect to the tensors of the block: its shards
        return Remat(_Gathering(module, block, layout, self.params), modules=[module])

    def active(self) -> _Forwards:
        """A context in which every block's forward gathers its params; on exit each block's
        ``forward`` is put back as it was (the class's, or one the user set, such as ``ft.remat``'s)."""
        return _Forwards(self.forwards)

    def split(self, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(the blocks' params, the others)``."""
        inside = {k: v for k, v in params.items() if k in self.params}
        return inside, {k: v for k, v in params.items() if k not in self.params}


class _Gathering:
    """A block's gathering forward (before remat): all-gather the shards in the block's slots, run the
    block's own forward on the full params."""

    def __init__(self, module: nn.Module, block: str, layout: ShardLayout, params: frozenset[str]) -> None:
        slots = [
            (sub, attr, f"{block}.{prefix}.{attr}" if prefix else f"{block}.{attr}")
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for attr in sub._parameters
        ]
        self.slots = [(sub, attr, name) for sub, attr, name in slots if name in params]
        self.shapes = {name: layout.global_shape(name) for _, _, name in self.slots}
        self.layout = layout
        self.dtype = layout.request.param_dtype
        self.own = _OwnForward(module)
        self.local = {name: "block." + name[len(block) + 1 :] for _, _, name in self.slots}
        self.block = block

    def __repr__(self) -> str:  # in remat's messages: remat(<the block ...>)
        return f"<the block {self.block!r}, its params gathered (fully_shard(blocks=...))>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # the slots hold this rank's shards (put there by the step's bind, or by remat's recompute);
        # functional_call puts the gathered params in for the call (dynamo refuses a plain assignment
        # to the slots inside the rematerialised block)
        shards = {name: sub._parameters[attr] for sub, attr, name in self.slots}
        full = self.layout.gather(shards, shapes=self.shapes, differentiable=True)
        dtype = self.dtype
        tensors = {self.local[n]: t if dtype is None else t.to(dtype) for n, t in full.items()}
        return torch.func.functional_call(self.own, tensors, args, kwargs, strict=False)


class _OwnForward(nn.Module):
    """A block (as ``.block``) run by its own forward, not the gathering one ``active()`` sets on it:
    what ``functional_call`` runs on the gathered params."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.block = module
        forward = module.forward
        # already ft.remat'ed: recompute once (the gathering forward is rematerialised)
        self.run = forward.fn if isinstance(forward, Remat) else forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class _Forwards:
    """Sets each block's ``forward`` for a block of code and puts back exactly what was there (nothing,
    unless the user set one). Plain code that dynamo traces inside the step; written through the
    instance ``__dict__``, whose entries dynamo tracks one by one: one added and removed within the
    step leaves nothing to replay after the graph (a ``setattr``/``delattr`` pair would replay the
    ``delattr``, on a module without the attribute)."""

    def __init__(self, forwards: tuple[tuple[nn.Module, Remat], ...]) -> None:
        self.forwards = forwards
        self.saved: list[tuple[dict[str, Any], Any]] = []

    def __enter__(self) -> None:
        for module, gathered in self.forwards:
            own = module.__dict__
            self.saved.append((own, own.get("forward")))
            own["forward"] = gathered

    def __exit__(self, *exc: Any) -> None:
        for own, old in reversed(self.saved):
            if old is None:
                del own["forward"]
            else:
                own["forward"] = old
        self.saved = []
