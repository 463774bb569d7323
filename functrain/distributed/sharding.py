"""Sharded training state (ZeRO-1/2/3): which rows of every parameter a rank keeps, and the collectives.

A :class:`Sharding` is the request (``fully_shard(group, level=...)``); ``TrainState.create(model, tx,
sharding=...)`` turns it into a :class:`ShardLayout` (the request plus every parameter's global shape),
kept in the state as a static field, so the step, ``state_dict()`` and the checkpoint writer all know
which leaves are shards.

A shard is a plain tensor: the leaf padded with zero rows on dim 0 to a multiple of the world size
(a 0-d leaf counts as one row), and rank ``r`` keeps rows ``[r * k, (r + 1) * k)`` (as ``torch.chunk``
and FSDP2 split). The optimizer is initialised on the local shards, so its moments are shards too and the
full optimizer state never exists. Padding rows are zero and stay zero (their gradients are zero), so
local sums of squares add up to the global norm.

Levels (one field, as DeepSpeed's ZeRO stages):

- ``"optimizer"`` (ZeRO-1): params replicated, optimizer state sharded; each step's gradients are
  accumulated whole over micro-batches and reduce-scattered once, the update runs on the local rows and
  the new params are all-gathered.
- ``"grads"`` (ZeRO-2): as ZeRO-1, but every micro-batch's gradients are reduce-scattered at once, so the
  accumulated gradient is a shard. With ``accumulate=1`` the two are the same step.
- ``"params"`` (ZeRO-3): params sharded at rest too; the step all-gathers them, runs forward and backward
  on the full params, reduce-scatters the gradients and updates the local rows. With ``blocks=`` (the
  model's repeated blocks, e.g. ``"auto"``) each block's params are gathered inside its forward and again
  in its backward (per-block recompute, :mod:`functrain.distributed.blocks`): one block's params are
  whole at a time, ZeRO-3's memory during the step too. A model without blocks keeps the savings at rest
  only: its step holds the full params and gradients.

Example:
    >>> import torch, functrain as ft
    >>> from functrain import distributed
    >>> sharding = distributed.fully_shard(level="params")  # no process group: one rank holds everything
    >>> state = ft.TrainState.create(torch.nn.Linear(3, 2), ft.optim.adamw(1e-3), sharding=sharding)
    >>> state.params["weight"].shape, state.layout.global_shape("weight")
    (torch.Size([2, 3]), (2, 3))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from functrain.core import foreach
from functrain.core.tree_walk import leaves_with_paths, rebuild
from functrain.distributed.block_spec import Blocks, check_blocks
from functrain.distributed.env import is_distributed

__all__ = ["LEVELS", "Level", "ShardLayout", "Sharding", "fully_shard"]

Level = Literal["optimizer", "grads", "params"]
LEVELS: tuple[str, ...] = ("optimizer", "grads", "params")
_ZERO = {"optimizer": 1, "grads": 2, "params": 3}


@dataclasses.dataclass(frozen=True, eq=False)
class Sharding:
    """What to shard, over which ranks. Made by :func:`fully_shard`; compared by identity.

    Example:
        >>> fully_shard(level="optimizer").zero_stage
        1
    """

    level: Level
    group: Any  # a ProcessGroup, or None for one process
    rank: int
    world_size: int
    buffers: Literal["mean", "local"] = "mean"
    param_dtype: torch.dtype | None = None
    blocks: Blocks = None

    @property
    def zero_stage(self) -> int:
        """1, 2 or 3, as DeepSpeed numbers the levels."""
        return _ZERO[self.level]

    @property
    def shards_params(self) -> bool:
        """True when params are sharded at rest (ZeRO-3)."""
        return self.level == "params"

    def rows(self, shape: tuple[int, ...]) -> int:
        """Rows of a leaf of global ``shape`` on each rank (a 0-d leaf is one row)."""
        return -(-(shape[0] if shape else 1) // self.world_size)

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each rank's shard of a leaf of global ``shape``."""
        return (self.rows(shape), *shape[1:])

    def __repr__(self) -> str:
        return f"Sharding(level={self.level!r}, rank={self.rank}, world_size={self.world_size})"


def fully_shard(
    group: Any = None,
    *,
    level: Level = "params",
    buffers: Literal["mean", "local"] = "mean",
    param_dtype: torch.dtype | None = None,
    blocks: Blocks = None,
) -> Sharding:
    """Request sharded training over ``group`` (a ProcessGroup or a 1-D DeviceMesh; default: every rank).

    Pass the result to ``TrainState.create(..., sharding=)`` and ``make_train_step(..., sharding=)``.

    Args:
        group: the ranks that share the state (default: the whole ``torchrun`` world, or one process).
        level: ``"optimizer"`` (ZeRO-1), ``"grads"`` (ZeRO-2) or ``"params"`` (ZeRO-3); see the module doc.
        buffers: BatchNorm statistics, replicated on every rank: ``"mean"`` averages each step's update
            over ranks (weighted by examples), ``"local"`` keeps each rank's own, as DDP does.
        param_dtype: gather (and compute with) params in this dtype, e.g. ``torch.bfloat16``; gradients
            are reduced, and the optimizer runs, in the params' own dtype (FSDP2's mixed precision).
            With ``blocks``, gathers move the params' own dtype and are cast after.
        blocks: ZeRO-3 only: the model's repeated blocks, whose params are gathered inside each block's
            forward and again in its backward (per-block recompute), so one block's params are whole at
            a time (:mod:`functrain.distributed.blocks`): ``"auto"`` (the entries of every
            ``nn.ModuleList`` of 2+ modules of one class), module classes, a list of names (of
            submodules, or of module classes: ``["BertLayer"]``) or a predicate ``(name, module) ->
            bool``. ``None`` (default): the whole model is gathered for the step; the state is sharded at
            rest, the step's peak holds the full params and gradients.

    Example:
        >>> sharding = fully_shard(level="grads", param_dtype=torch.bfloat16)
        >>> sharding.zero_stage, sharding.world_size
        (2, 1)
        >>> fully_shard(blocks=torch.nn.TransformerEncoderLayer).blocks
        <class 'torch.nn.modules.transformer.TransformerEncoderLayer'>
    """
    if level not in LEVELS:
        raise ValueError(f"fully_shard: level must be one of {LEVELS} (ZeRO-1/2/3), got {level!r}")
    if buffers not in ("mean", "local"):
        raise ValueError(f"fully_shard: buffers must be 'mean' or 'local', got {buffers!r}")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(f"fully_shard: param_dtype must be a floating dtype, got {param_dtype}")
    if blocks is not None:
        if level != "params":
            raise ValueError(
                f"fully_shard: blocks= gathers params inside each block, so it needs level='params' "
                f"(ZeRO-3), got level={level!r}: drop blocks= or shard the params"
            )
        if isinstance(blocks, str) and blocks != "auto":
            raise ValueError(f"fully_shard: blocks must be 'auto' or a list of names, got {blocks!r}")
        check_blocks(blocks)
    mesh_type = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ValueError(f"fully_shard: the DeviceMesh must be 1-D, got {group.ndim} dimensions")
        group = group.get_group()
    if group is None and is_distributed():
        group = dist.group.WORLD
    if group is None:
        return Sharding(level, None, 0, 1, buffers, param_dtype, blocks)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return Sharding(level, group, rank, world, buffers, param_dtype, blocks)


# ----------------------------------------------------------------------------------------- row blocks


def pad_rows(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``x`` (a 0-d leaf as one row) with zero rows appended on dim 0 up to a multiple of ``world_size``."""
    x = x.reshape(1) if x.ndim == 0 else x
    extra = -x.shape[0] % world_size
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])


def local_rows(x: torch.Tensor, sharding: Sharding) -> torch.Tensor:
    """This rank's block of rows of the full leaf ``x`` (a view where no padding was needed)."""
    padded = pad_rows(x, sharding.world_size)
    return padded.reshape(sharding.world_size, -1, *padded.shape[1:])[sharding.rank]


def _collective(op: str, tensor: torch.Tensor, *args: Any, group: Any) -> torch.Tensor:
    """``torch.ops._c10d_functional.<op>(tensor, *args, group name)``, waited on at once: a plain tensor.

    funcol's wrappers return an ``AsyncCollectiveTensor`` eagerly; inside ``torch.func``'s transforms
    (the blocks' backward) it comes back wrapped, is never waited on, and c10d's work registry keeps
    the collective's input alive until the end of the step (+4 MB per block of an 8 x Linear(1024)
    model on 2 ranks). These ops are the ones funcol traces to; under torch.compile the wait is traced.
    """
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(getattr(ops, op)(tensor, *args, group.group_name))


def _by_dtype(
    names: list[str], dtype_of: Callable[[str], torch.dtype]
) -> Iterator[tuple[torch.dtype, list[str]]]:
    """Names grouped by dtype (first-seen order): one collective per dtype, not one per leaf."""
    groups: dict[torch.dtype, list[str]] = {}
    for name in names:
        groups.setdefault(dtype_of(name), []).append(name)
    yield from groups.items()


class _AllGather(torch.autograd.Function):
    """All-gather on dim 0 whose backward is the reduce-scatter (sum) of the gradient.

    The functional collectives' own autograd is a ``torch.library`` Function that ``torch.func``
    refuses (no ``setup_context``); this one has it, and its forward neither detaches nor disables
    gradients (compiled, that would make every gradient 0: SHARDING_FACTS.md)."""

    @staticmethod
    def forward(flat: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
        return _collective("all_gather_into_tensor", flat, world_size, group=group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.world_size = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mine = _collective("reduce_scatter_tensor", grad.contiguous(), "sum", ctx.world_size, group=ctx.group)
        return mine, None, None


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where a sharded state's rows live: the request (``fully_shard(...)``) and every parameter's global shape
    (``TrainState.layout``, a static field of the state).

    Example:
        >>> layout = ShardLayout(fully_shard(), (("w", (5, 2)),))
        >>> layout.global_shape("w"), layout.request.local_shape((5, 2))
        ((5, 2), (5, 2))
    """

    request: Sharding  # what fully_shard(...) asked for
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def global_shape(self, name: str) -> tuple[int, ...]:
        """The full shape of parameter ``name``."""
        for key, shape in self.shapes:
            if key == name:
                return shape
        raise KeyError(f"{name!r} is not a parameter of this sharded state")

    @property
    def num_params(self) -> int:
        """Parameter elements of the whole model (all ranks' shards, padding excluded)."""
        return sum(math.prod(shape) for _, shape in self.shapes)

    # ------------------------------------------------------------------ traced collectives (the step)

    def gather(
        self,
        local: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        *,
        differentiable: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The full params from every rank's shards: one functional all-gather per dtype, traceable.

        ``dtype`` casts the shards before the gather (bf16 gathers move half the bytes); ``shapes``
        gives the global shapes of leaves that are not params (optimizer moments). ``differentiable``:
        the gather's backward reduce-scatters the gradient (summed over ranks), under ``torch.func``
        transforms too (ZeRO-3 with blocks, :mod:`functrain.distributed.blocks`)."""
        s = self.request
        out: dict[str, torch.Tensor] = {}
        names = list(local)
        for dt, group in _by_dtype(names, lambda n: dtype or local[n].dtype):
            flats = [local[n].to(dt).reshape(-1) for n in group]
            if s.world_size == 1:
                gathered = [f.reshape(1, -1) for f in flats]
            else:
                if differentiable:
                    flat = _AllGather.apply(torch.cat(flats), s.group, s.world_size)
                else:
                    flat = _collective(
                        "all_gather_into_tensor", torch.cat(flats), s.world_size, group=s.group
                    )
                gathered = list(flat.reshape(s.world_size, -1).split([f.numel() for f in flats], dim=1))
            for n, piece in zip(group, gathered):
                shape = shapes[n] if shapes is not None else self.global_shape(n)
                rows = piece.reshape(s.world_size * local[n].shape[0], *local[n].shape[1:])
                kept = shape[0] if shape else 1
                # no slice where there is no padding: its backward would allocate the whole gradient again
                out[n] = (rows if kept == rows.shape[0] else rows[:kept]).reshape(shape)
        return {n: out[n] for n in names}

    def reduce_scatter(
        self, full: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]
    ) -> dict[str, torch.Tensor]:
        """Each rank's rows of the sum over ranks of ``full`` (gradients), reduced in ``dtypes[name]``:
        one functional reduce-scatter per dtype, traceable."""
        s = self.request
        out: dict[str, torch.Tensor] = {}
        names = list(full)
        for dt, group in _by_dtype(names, lambda n: dtypes[n]):
            blocks = [pad_rows(full[n].to(dt), s.world_size).reshape(s.world_size, -1) for n in group]
            if s.world_size == 1:
                pieces = [b.reshape(-1) for b in blocks]
            else:
                flat = torch.cat(blocks, dim=1).reshape(-1)
                mine = _collective("reduce_scatter_tensor", flat, "sum", s.world_size, group=s.group)
                pieces = list(mine.split([b.shape[1] for b in blocks]))
            for n, piece in zip(group, pieces):
                out[n] = piece.reshape(s.local_shape(self.global_shape(n)))
        return {n: out[n] for n in names}

    def norm_fn(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
        """The per-leaf norms of all ranks' rows (``functrain.optim.NormFn``) for leaves sharded as this
        layout's request; ``None`` on one rank (each leaf is whole)."""
        if self.request.world_size == 1:
            return None
        return lambda leaves: self.global_norms(list(foreach.norm(leaves)))

    def apply_full_gradients(self, state: Any, grads: Mapping[str, torch.Tensor]) -> Any:
        """``state.apply_gradients(grads)`` for a state sharded by this layout: ``grads`` are whole and
        already reduced (the same on every rank); this rank's rows update its shards."""
        from functrain.optim import apply_gradients

        norm = self.norm_fn()
        local_grads = {k: local_rows(g, self.request) for k, g in grads.items()}
        local, opt_state = apply_gradients(
            state.tx, local_grads, state.opt_state, self.local(state.params), norm=norm
        )
        return state.replace(step=state.step + 1, params=self.at_rest(local), opt_state=opt_state)

    def local(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows the optimizer updates on this rank: the shards themselves (ZeRO-3), or this rank's
        rows of the replicated params (ZeRO-1/2)."""
        if self.request.shards_params:
            return dict(params)
        return {n: local_rows(p, self.request) for n, p in params.items()}

    def at_rest(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Updated local rows back to the params the state keeps: unchanged (ZeRO-3) or all-gathered."""
        if self.request.shards_params:
            return dict(local)
        return self.gather(local)

    def global_norms(self, norms: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-leaf norms of all ranks' rows from each rank's local norms: an all-reduce of the squares
        (in float64, so the combined norm rounds like one computed whole)."""
        if self.request.world_size == 1 or not norms:
            return norms
        squares = torch.stack([n.to(torch.float64) for n in norms]).square()
        total = _collective("all_reduce", squares, "sum", group=self.request.group).sqrt()
        return [total[i].to(n.dtype) for i, n in enumerate(norms)]

    def forward_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The params a forward runs on (the eval step's): ZeRO-3's shards gathered (in ``param_dtype``
        if set), else the params as they are. Traceable."""
        if self.request.shards_params:
            return self.gather(params, self.request.param_dtype)
        return dict(params)

    # ------------------------------------------------------------------ eager, outside the step

    def full_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole params on every rank (eager; for ``state_dict()``/export): one leaf at a time.
        Collective: every rank calls it."""
        if not self.request.shards_params:
            return dict(params)
        return {n: self.gather({n: p})[n] for n, p in params.items()}

    def sharded_leaves(self, state: Any) -> dict[tuple[Any, ...], tuple[int, ...]]:
        """``{path: global shape}`` of the state's leaves that are shards (paths as
        ``functrain.checkpoint.structure`` names them); every other leaf is replicated.

        Params are shards under ZeRO-3; an optimizer-state leaf is the shard of a param when its path
        ends with that param's name and it has the shard's shape (``tx.init`` made it from the shard)."""
        shapes = dict(self.shapes)
        out: dict[tuple[Any, ...], tuple[int, ...]] = {}
        for path, leaf in leaves_with_paths(state):
            if not isinstance(leaf, torch.Tensor) or not path:
                continue
            name = path[-1]
            if path[0] == "params":
                if self.request.shards_params:
                    out[path] = shapes[name]
            elif (
                path[0] == "opt_state"
                and isinstance(name, str)
                and name in shapes
                and tuple(leaf.shape) == self.request.local_shape(shapes[name])
            ):
                out[path] = shapes[name]
        return out

    def full_state(self, state: Any) -> Any:
        """The state with every shard gathered (params and optimizer state whole, ``layout=None``):
        what one process training on the same data would hold. Collective, one leaf at a time."""
        sharded = self.sharded_leaves(state)

        def leaf(path: tuple[Any, ...], x: Any) -> Any:
            if path not in sharded:
                return x
            return self.gather({"leaf": x}, shapes={"leaf": sharded[path]})["leaf"]

        return rebuild(state, leaf).replace(layout=None)


# ----------------------------------------------------------------------------------------- creation


def _source(sharding: Sharding) -> int:
    return dist.get_global_rank(sharding.group, 0) if sharding.world_size > 1 else 0


def _synced(
    x: torch.Tensor, sharding: Sharding, device: torch.device | None, dtype: torch.dtype | None
) -> torch.Tensor:
    """Rank 0's value of a leaf on every rank (eager broadcast); other ranks may hold it on ``meta``."""
    cast = dtype if dtype is not None and x.is_floating_point() else x.dtype
    if sharding.world_size == 1:
        if x.is_meta:
            raise ValueError(
                "TrainState.create(sharding=...): the model is on the meta device and there is no other "
                "rank to broadcast its weights from; materialise it first (model.to_empty(device=...) "
                "and reset_parameters()), or load it on rank 0"
            )
        return x.detach().to(device=device, dtype=cast)
    target = device if device is not None else (torch.device("cpu") if x.is_meta else x.device)
    if sharding.rank == 0:
        if x.is_meta:
            raise ValueError(
                "TrainState.create(sharding=...): rank 0's model is on the meta device; rank 0 must hold "
                "the weights (the other ranks may keep theirs on meta): load or initialise it there"
            )
        out = x.detach().to(device=target, dtype=cast).contiguous().clone()
    else:
        out = torch.empty(x.shape, dtype=cast, device=target)
    dist.broadcast(out, src=_source(sharding), group=sharding.group)
    return out


def shard_variables(
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    sharding: Sharding,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], ShardLayout]:
    """Rank 0's params and buffers, broadcast leaf by leaf, each param cut to this rank's rows at once
    (ZeRO-3; a full leaf at a time is the peak), with the layout to put in the state."""
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"sharding must come from functrain.distributed.fully_shard(...), got {type(sharding).__name__}"
        )
    dev = torch.device(device) if device is not None else None
    out_params: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        full = _synced(p, sharding, dev, dtype)
        out_params[name] = local_rows(full, sharding).clone() if sharding.shards_params else full
        del full
    out_buffers = {name: _synced(b, sharding, dev, dtype) for name, b in buffers.items()}
    layout = ShardLayout(sharding, tuple((n, tuple(p.shape)) for n, p in params.items()))
    return out_params, out_buffers, layout
