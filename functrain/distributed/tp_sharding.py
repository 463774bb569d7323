"""ZeRO over the data-parallel axis of a ``(dp, tp)`` mesh, for params placed as DTensors on the tp mesh.

Every rank of the mesh keeps ``1 / (dp * tp)`` of each leaf it shards (the optimizer moments at every
level, the params too at ZeRO-3). What a rank keeps of a param is a *row piece*, itself a DTensor on the
tp mesh, so the optimizer's norms know which leaves are split (:meth:`TPShards.norms`):

- a param split over tp (``Shard(d)``): the rows (dim 0) of this rank's tp part, cut over dp as
  :mod:`functrain.distributed.sharding` cuts a plain leaf (padded with zero rows to a multiple of dp);
  the row pieces of a tp group form a DTensor placed ``Shard(d)`` as the param is;
- a param replicated over tp: its rows padded with zeros to a multiple of ``dp * tp``, dp rank ``i``
  keeping the ``i``-th block of ``tp * k`` rows, which its tp group splits ``Shard(0)``: ``k`` rows each.

Zero padding rows stay zero (their gradients are zero), so the sums of squares over the mesh are the
whole leaves' norms. The collectives are functional and traced into the compiled step: the gradients
are reduce-scattered over dp (a replicated param's whole gradient, then each tp rank slices its rows of
the dp block), the params all-gathered over tp (the replicated ones) and dp.

Example:
    >>> from functrain.distributed.tp_sharding import row_shape  # the global shape of a row piece
    >>> from torch.distributed.tensor import Replicate, Shard
    >>> row_shape((8, 4), Shard(0), dp=2, tp=2), row_shape((13, 8), Replicate(), dp=2, tp=2)
    ((4, 4), (8, 8))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from functrain.core import foreach
from functrain.distributed.sharded_step import weigh_grads
from functrain.distributed.sharding import Sharding, ShardLayout, _by_dtype, _collective, local_rows, pad_rows

__all__ = ["TPShards", "row_shape"]


def row_shape(shape: tuple[int, ...], placement: Placement, *, dp: int, tp: int) -> tuple[int, ...]:
    """The global shape of the DTensor of row pieces of a param of ``shape`` placed ``placement`` on tp."""
    if isinstance(placement, Shard):
        local = list(shape)
        local[placement.dim] //= tp
        rows = list(local)
        rows[0] = -(-local[0] // dp)
        rows[placement.dim] *= tp
        return tuple(rows)
    return (_padded(shape, dp * tp) // dp, *shape[1:])


def _padded(shape: tuple[int, ...], ranks: int) -> int:
    rows = shape[0] if shape else 1
    return -(-rows // ranks) * ranks


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


class TPShards:
    """The ZeRO geometry of a tensor-parallel state (see the module doc); made by ``TensorParallel``.

    Example:
        >>> shards = TPShards(sharding, tp_mesh, {"w": (Shard(0),)}, {"w": (8, 4)})  # doctest: +SKIP
        >>> shards.rows({"w": w})["w"].to_local().shape  # doctest: +SKIP
        torch.Size([2, 4])
    """

    def __init__(
        self,
        sharding: Sharding,
        mesh: DeviceMesh,
        placements: Mapping[str, tuple[Placement, ...]],
        shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        self.request, self.mesh = sharding, mesh
        self.dp, self.tp, self.t = sharding.world_size, mesh.size(), mesh.get_local_rank()
        self.tp_group = mesh.get_group()
        self.placements, self.shapes = dict(placements), dict(shapes)
        self.replicated = frozenset(n for n, p in self.placements.items() if not isinstance(p[0], Shard))
        dp_shapes = {}  # what the dp axis cuts: this rank's tp part, or a replicated leaf padded
        for name, shape in self.shapes.items():
            if name in self.replicated:
                dp_shapes[name] = (_padded(shape, self.dp * self.tp), *shape[1:])
            else:
                local = list(shape)
                local[self.placements[name][0].dim] //= self.tp
                dp_shapes[name] = tuple(local)
        self.layout = ShardLayout(sharding, tuple(dp_shapes.items()))
        self.row_shapes = {
            n: row_shape(s, self.placements[n][0], dp=self.dp, tp=self.tp) for n, s in self.shapes.items()
        }

    # ------------------------------------------------------------------ one leaf's pieces

    def wrap(self, name: str, piece: torch.Tensor) -> DTensor:
        """This rank's row piece of ``name`` as the DTensor of the tp group's pieces."""
        shape = self.row_shapes[name]
        placement = (Shard(0),) if name in self.replicated else self.placements[name]
        return DTensor.from_local(
            piece, self.mesh, placement, run_check=False, shape=torch.Size(shape), stride=_strides(shape)
        )

    def _cut(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of its tp part (a replicated leaf: its rows of the padded whole)."""
        if name not in self.replicated:
            return local_rows(local, self.request)
        block = local_rows(pad_rows(local, self.dp * self.tp), self.request)
        return block.chunk(self.tp)[self.t]

    # ------------------------------------------------------------------ the state's leaves

    def rows(self, full: Mapping[str, DTensor]) -> dict[str, DTensor]:
        """Row pieces of whole DTensors (placed as the plan places the params)."""
        return {n: self.wrap(n, self._cut(n, x.to_local())) for n, x in full.items()}

    def whole(self, rows: Mapping[str, DTensor]) -> dict[str, DTensor]:
        """The whole DTensors (placed as the plan places the params) from every rank's row pieces: one
        all-gather over tp per dtype (the replicated leaves), one over dp per dtype. Traceable."""
        local = {n: x.to_local() for n, x in rows.items()}
        rep = [n for n in local if n in self.replicated]
        if rep and self.tp > 1:
            for _, group in _by_dtype(rep, lambda n: local[n].dtype):
                flat = torch.cat([local[n].reshape(-1) for n in group])
                out = _collective("all_gather_into_tensor", flat, self.tp, group=self.tp_group)
                parts = out.reshape(self.tp, -1).split([local[n].numel() for n in group], dim=1)
                for n, part in zip(group, parts):
                    local[n] = part.reshape(self.tp * local[n].shape[0], *local[n].shape[1:])
        gathered = self.layout.gather(local)
        out: dict[str, DTensor] = {}
        for n, x in gathered.items():
            shape = self.shapes[n]
            if n in self.replicated:
                x = x[: (shape[0] if shape else 1)].reshape(shape)
            out[n] = DTensor.from_local(
                x, self.mesh, self.placements[n], run_check=False, shape=torch.Size(shape),
                stride=_strides(shape),
            )  # fmt: skip
        return out

    def scatter(
        self, grads: Mapping[str, DTensor], master: Mapping[str, torch.dtype], examples: Any
    ) -> dict[str, torch.Tensor]:
        """This rank's rows (plain) of the sum over dp of ``grad * examples`` (gradients placed as their
        params), in the ``master`` dtypes: one reduce-scatter per dtype. Traceable."""
        local = weigh_grads({n: g.to_local() for n, g in grads.items()}, master, examples)
        padded = {n: pad_rows(g, self.dp * self.tp) if n in self.replicated else g for n, g in local.items()}
        mine = self.layout.reduce_scatter(padded, master)
        return {n: g.chunk(self.tp)[self.t] if n in self.replicated else g for n, g in mine.items()}

    def is_rows(self, name: str, x: Any) -> bool:
        """Whether ``x`` is a row piece of param ``name`` (a DTensor of its row shape)."""
        return isinstance(x, DTensor) and tuple(x.shape) == self.row_shapes.get(name)

    # ------------------------------------------------------------------ norms

    def norms(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-leaf L2 norms of the whole leaves from row pieces (``functrain.optim.NormFn``): the local
        norms' squares summed in float64 over dp, then over tp (every row piece is split over tp)."""
        if not leaves:
            return []
        for i, x in enumerate(leaves):
            if not isinstance(x, DTensor):
                raise TypeError(
                    f"tensor parallelism with ZeRO: leaf {i} of a norm is a plain tensor of shape "
                    f"{tuple(x.shape)}, not a row piece of a param; its norm over the mesh is unknown"
                )
        norms = list(foreach.norm([x.to_local() for x in leaves]))
        squares = torch.stack([n.to(torch.float64) for n in norms]).square()
        if self.dp > 1:
            squares = _collective("all_reduce", squares, "sum", group=self.request.group)
        if self.tp > 1:
            squares = _collective("all_reduce", squares, "sum", group=self.tp_group)
        total = squares.sqrt()
        return [total[i].to(n.dtype) for i, n in enumerate(norms)]
