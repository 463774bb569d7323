"""Which slice of the data a process reads, and the check that a tensor-parallel group read one slice.

Under data parallelism every ``torchrun`` rank reads its own slice of each global batch. Under tensor
parallelism (a state placed by :func:`functrain.distributed.tensor_parallel`) the ranks of a tp group
compute one model on **one** batch: the data is sliced by the *dp* coordinate only (a ``(dp, tp)`` mesh
of ``world / tp`` groups), every rank of a group reads its group's slice, and only the group's first rank
counts its evaluation sums (the others computed the same numbers). :func:`data_ranks` says which;
``fit``, ``evaluate`` and the Trainer read their data by it.

Nothing in the step can see that a group's ranks were given different batches: DTensor takes a plain
tensor as replicated and each rank computes with its own. :func:`check_same_batch` compares a digest of
the batch over the tp group (one small collective, where it is called: ``fit`` calls it on its first step,
on every step with ``check_batches="every"``) and raises naming the ranks.

Example:
    >>> data_ranks(None)  # one process, or no tensor-parallel state: every rank its own slice
    DataRanks(rank=0, world_size=1, tp_rank=0, tp_size=1, tp_group=None)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
import torch.distributed as dist

from functrain import tree
from functrain.distributed.env import is_distributed, rank, world_size

__all__ = [
    "DataRanks",
    "check_same_batch",
    "counted_once",
    "data_ranks",
    "plain_outputs",
    "tp_mesh",
    "tp_size",
    "whole_tensors",
]

_TP_MODULE = "functrain.distributed.tensor_parallel"  # DTensor's imports: only asked once it is loaded


@dataclasses.dataclass(frozen=True)
class DataRanks:
    """``rank`` of ``world_size`` slices of the data this process reads; ``tp_rank`` of ``tp_size``: its
    place in the tp group that reads the same slice (``tp_group``: that group's process group, ``None``
    without tensor parallelism)."""

    rank: int
    world_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None

    @property
    def counts(self) -> bool:
        """Whether this process's evaluation sums count (the first rank of its tp group)."""
        return self.tp_rank == 0


def tp_mesh(state: Any) -> Any:
    """The tp ``DeviceMesh`` of a state placed by ``TensorParallel.place`` (``None`` for any other state).
    Asks nothing of DTensor unless the tensor-parallel module was loaded.

    Example:
        >>> tp_mesh(None) is None
        True
    """
    module = sys.modules.get(_TP_MODULE)
    layout = getattr(state, "layout", None)
    if module is None or not isinstance(layout, module.TensorParallel):
        return None
    return layout.mesh


def tp_size(state: Any) -> int:
    """The ranks of ``state``'s tp group (1 for a state that is not tensor-parallel). Not collective.

    Example:
        >>> tp_size(None)
        1
    """
    mesh = tp_mesh(state)
    return 1 if mesh is None else mesh.size()


def data_ranks(state: Any) -> DataRanks:
    """This process's slice of the data for a step on ``state``: its rank among all under data
    parallelism; under tensor parallelism its tp group's index among the ``world / tp`` groups (every rank
    of a group the same). Collective for a tensor-parallel state (one small all-gather of each group's first
    rank): every rank calls it together.

    Example:
        >>> data_ranks(None).world_size
        1
    """
    mesh = tp_mesh(state)
    if mesh is None or not is_distributed():
        return DataRanks(rank(), world_size())
    size, world = mesh.size(), world_size()
    if world % size:
        raise ValueError(
            f"tensor parallelism: a tp group of {size} ranks in a world of {world}: the groups must split the "
            "world evenly; make the mesh (dp, tp) with dp * tp = world size"
        )
    leader = int(mesh.mesh.min())  # the group's first global rank names the group
    leaders: list[Any] = [None] * world
    dist.all_gather_object(leaders, leader)  # in memory only: nothing read back from a file
    groups = sorted(set(leaders))
    if len(groups) * size != world:
        raise ValueError(
            f"tensor parallelism: the ranks form {len(groups)} tp groups of {size}, which is not the world "
            f"of {world}: every rank must place its state on a tp mesh of the same size"
        )
    return DataRanks(groups.index(leader), len(groups), mesh.get_local_rank(), size, mesh.get_group())


def counted_once(metric: Any, state: Any, ranks: DataRanks) -> Any:
    """A train metric ``state`` ready to be all-reduced over every rank so that each tp group counts once:
    on a group's other ranks (which computed the same state) its ``"sum"`` leaves are zeroed; ``"max"`` and
    ``"min"`` leaves are kept (the group's copies agree). Unchanged without tensor parallelism.

    Example:
        >>> from functrain import metrics
        >>> acc = metrics.Accuracy()
        >>> state = acc.empty()
        >>> counted_once(acc, state, data_ranks(None)) is state  # no tp group: every rank counts
        True
    """
    if ranks.counts or state is None:
        return state
    zeroed = lambda x, op: torch.zeros_like(x) if op == "sum" and isinstance(x, torch.Tensor) else x  # noqa: E731
    return tree.map(zeroed, state, metric.reductions())


def check_same_batch(batch: Any, ranks: DataRanks, step: int) -> None:
    """Raise when the ranks of this tp group were given different batches for training step ``step``
    (a digest of the batch's bytes, shapes and dtypes compared with one all-gather over the group; the
    batch is read back to the host). Nothing without tensor parallelism. Every rank of the group calls it.

    Example:
        >>> check_same_batch({"x": [1, 2]}, data_ranks(None), 1)  # no tp group: nothing to compare
    """
    if ranks.tp_group is None or ranks.tp_size == 1:
        return
    from functrain.core.fingerprint import fingerprint

    digests: list[Any] = [None] * ranks.tp_size
    dist.all_gather_object(digests, (rank(), fingerprint(batch)), group=ranks.tp_group)
    if len({digest for _, digest in digests}) == 1:
        return
    seen: dict[str, list[int]] = {}
    for global_rank, digest in digests:
        seen.setdefault(digest, []).append(global_rank)
    who = "; ".join(f"ranks {r} got batch {d[:8]}" for d, r in seen.items())
    raise ValueError(
        f"tensor parallelism: the ranks of one tp group were given different batches for training step "
        f"{step} ({who}); every rank of a tp group must get the same batch, or each computes with its own "
        "and the split weights' gradients are wrong in silence. Shard the data by the dp rank only "
        "(fit, evaluate and the Trainer do it for a dataset or a functrain Loader: "
        "functrain.distributed.data_ranks.data_ranks(state)); a torch DataLoader with a DistributedSampler "
        "over all ranks gives each rank its own"
    )


def plain_outputs(outputs: Any, ranks: DataRanks) -> Any:
    """A step's outputs with every DTensor whole, as a plain tensor (a tensor-parallel step's loss and
    logits are replicated DTensors), so that they sum and merge with plain tensors; as they are without
    tensor parallelism.

    Example:
        >>> plain_outputs({"loss": 1.0}, data_ranks(None))
        {'loss': 1.0}
    """
    return outputs if ranks.tp_size == 1 else whole_tensors(outputs)


def whole_tensors(values: Any) -> Any:
    """``values`` with every DTensor whole, as a plain tensor (a replicated one: no communication). Asks
    nothing of DTensor unless the tensor-parallel module was loaded.

    Example:
        >>> whole_tensors({"loss": 1.0})
        {'loss': 1.0}
    """
    if _TP_MODULE not in sys.modules:
        return values
    from torch.distributed.tensor import DTensor

    return tree.map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, values)
