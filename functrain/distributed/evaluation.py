"""Merging one evaluation across ranks: loss sum, example count, extra sums and metric states.

Each rank evaluates its shard; :func:`merge_evaluation` all-reduces what it accumulated so every rank
ends with the sums of the whole set. A rank whose shard was empty (a set smaller than the world) takes
part with zeros and an empty metric state, so the collectives still match.

Example:
    >>> import torch
    >>> loss_sum, count, extra, merged = merge_evaluation(torch.tensor(6.0), 3, {}, None, None, "cpu")
    >>> float(loss_sum), int(count)
    (6.0, 3)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functrain.distributed.env import is_distributed
from functrain.distributed.reduce import all_reduce_metric_state, all_reduce_tree

__all__ = ["merge_evaluation"]


def merge_evaluation(
    loss_sum: torch.Tensor | None,
    count: int,
    extra_sums: dict[str, Any],
    merged: Any,
    metric: Any,
    device: str | torch.device,
) -> tuple[torch.Tensor | None, int, dict[str, Any], Any]:
    """``(loss_sum, count, extra_sums, metric_state)`` summed (metric states reduced) over all ranks.

    Without a process group the inputs come back unchanged. Every rank must call it.

    Example:
        >>> merge_evaluation(None, 0, {}, None, None, "cpu")
        (None, 0, {}, None)
    """
    if not is_distributed():
        return loss_sum, count, extra_sums, merged
    # Ranks can disagree on which extra metrics they saw only when one saw no examples at all: agree on
    # the names (one small host collective per evaluation) before packing tensors by position.
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, (sorted(extra_sums), merged is not None))
    all_extra = sorted({k for keys, _ in names for k in keys})
    any_metrics = any(has for _, has in names)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    sums = {
        "loss": (loss_sum if loss_sum is not None else zero).detach().float().reshape(()),
        "count": torch.tensor(float(count), dtype=torch.float64, device=device),
        "extra": {k: torch.as_tensor(extra_sums.get(k, zero), device=device).float() for k in all_extra},
    }
    sums = all_reduce_tree(sums, "sum")
    if any_metrics and metric is not None:
        merged = all_reduce_metric_state(metric, merged if merged is not None else metric.empty(device))
    total = int(sums["count"])
    return (sums["loss"] if total else None), total, dict(sums["extra"]), merged
