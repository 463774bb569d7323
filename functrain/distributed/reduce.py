"""Cross-rank reductions on the host: metric states and evaluation sums, merged over all ranks.

Each rank evaluates its shard of the data. Metric states are built to be merged (``merge`` for batches,
``reductions()`` for ranks: ``"sum"``, ``"max"`` or ``"min"`` per leaf), so all-reducing every leaf by its
reduction gives exactly the state one process would have accumulated over the whole set; the metric
computed from it is the whole set's, not an average of per-rank results.

Example:
    >>> import torch
    >>> from functrain import distributed, metrics
    >>> avg = metrics.Average()
    >>> state = avg.update(avg.empty(), loss=torch.tensor(2.0), num_examples=3)
    >>> float(avg.compute(distributed.all_reduce_metric_state(avg, state)))  # one process: unchanged
    2.0
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functrain import tree
from functrain.distributed.env import is_distributed

__all__ = ["all_reduce_metric_state", "all_reduce_tree"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_tree(values: Any, reductions: Any) -> Any:
    """``values`` with every tensor leaf all-reduced across ranks by the matching leaf of ``reductions``.

    ``reductions`` has ``values``'s structure with ``"sum"``, ``"max"`` or ``"min"`` at each leaf (or is
    one of those strings for all leaves). Leaves are packed by (reduction, dtype, device): a handful of
    collectives whatever the number of leaves. Every rank must call it with the same structure.

    Example:
        >>> all_reduce_tree({"total": torch.tensor(3.0), "peak": torch.tensor(7)}, {"total": "sum", "peak": "max"})
        {'total': tensor(3.), 'peak': tensor(7)}
    """
    leaves, spec = tree.flatten(values)
    if isinstance(reductions, str):
        ops = [reductions] * len(leaves)
    else:
        ops = tree.leaves(reductions)
        if len(ops) != len(leaves):
            raise ValueError(
                f"all_reduce_tree: {len(leaves)} value leaves but {len(ops)} reductions; reductions() must "
                "mirror the state's structure with 'sum'/'max'/'min' at each tensor leaf"
            )
    for op in ops:
        if op not in _OPS:
            raise ValueError(f"all_reduce_tree: unknown reduction {op!r}; use 'sum', 'max' or 'min'")
    if not is_distributed():
        return tree.unflatten(spec, leaves)

    nccl = dist.get_backend() == "nccl"
    groups: dict[tuple[str, torch.dtype, torch.device], list[int]] = {}
    for i, (x, op) in enumerate(zip(leaves, ops)):
        if isinstance(x, torch.Tensor):
            groups.setdefault((op, x.dtype, x.device), []).append(i)
    out = list(leaves)
    for (op, _dtype, device), idx in groups.items():
        comm = torch.device("cuda", torch.cuda.current_device()) if nccl and device.type == "cpu" else device
        flat = torch.cat([leaves[i].detach().reshape(-1) for i in idx]).to(comm)
        dist.all_reduce(flat, op=_OPS[op])
        for i, part in zip(idx, torch.split(flat, [leaves[i].numel() for i in idx])):
            out[i] = part.reshape(leaves[i].shape).to(device)
    return tree.unflatten(spec, out)


def all_reduce_metric_state(metric: Any, state: Any) -> Any:
    """A metric (or ``Collection``) state merged across ranks with the metric's ``reductions()``.

    Example:
        >>> from functrain import metrics
        >>> acc = metrics.Accuracy()
        >>> merged = all_reduce_metric_state(acc, acc.empty())
    """
    if state is None or not is_distributed():
        return state
    return all_reduce_tree(state, metric.reductions())
