"""The data-parallel layout a run trains with, saved with each checkpoint and checked on resume.

A checkpoint's data position counts *global* steps: step ``s`` of an epoch consumed examples
``[s * G, (s + 1) * G)`` of that epoch's permutation, ``G = batch_size * world_size`` being the global
batch, whatever the world size. Resuming with another world size therefore continues from exactly the
same global example when ``G`` is unchanged (2 ranks x 16 -> 1 rank x 32: the same global batches, the
same updates up to float rounding). With another ``G`` the position would point elsewhere in the epoch,
so :func:`check_resume` refuses it with a message saying which batch size keeps it valid.

Example:
    >>> layout(batch_size=16, world_size=2)
    {'data_parallel': {'world_size': 2, 'batch_size': 16, 'global_batch_size': 32}}
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TENSOR_PARALLEL",
    "LayoutMismatchError",
    "check_resume",
    "layout",
    "loader_layout",
    "tensor_parallel_layout",
]

TENSOR_PARALLEL = "tensor_parallel"
"""The metadata key of a tensor-parallel state's layout (:func:`tensor_parallel_layout`), by the state's
path in the saved tree."""


class LayoutMismatchError(ValueError):
    """A checkpoint's data position is not valid for this run's global batch size."""


def layout(batch_size: int | None, world_size: int) -> dict[str, Any]:
    """Checkpoint metadata describing the data-parallel layout (empty when the batch size is unknown).

    Example:
        >>> layout(None, 1)
        {}
    """
    if batch_size is None:
        return {}
    return {
        "data_parallel": {
            "world_size": world_size,
            "batch_size": batch_size,
            "global_batch_size": batch_size * world_size,
        }
    }


def loader_layout(loader: Any) -> dict[str, Any]:
    """:func:`layout` of a ``functrain.data.Loader`` over a map-style dataset (``{}`` for other data).

    Example:
        >>> from functrain.data import Loader
        >>> loader_layout(Loader(list(range(8)), 4, shuffle=False))
        {'data_parallel': {'world_size': 1, 'batch_size': 4, 'global_batch_size': 4}}
    """
    source = getattr(loader, "_source", None)
    batch_size = getattr(source, "batch_size", None)
    world = getattr(source, "world_size", None)
    if not isinstance(batch_size, int) or not isinstance(world, int):
        return {}
    return layout(batch_size, world)


def tensor_parallel_layout(strategy: Any) -> dict[str, Any]:
    """Checkpoint metadata describing a ``TensorParallel`` strategy's layout: the tp and dp sizes, the
    plan, and the dim each split param is split on (the file itself holds whole tensors).

    Example:
        >>> tensor_parallel_layout(tp)  # doctest: +SKIP
        {'tp': 2, 'dp': 2, 'plan': {'*attn.q': 'colwise', ...}, 'split': {'blocks.0.attn.q.weight': 0, ...}}
    """
    dp = getattr(strategy, "dp", None)
    return {
        "tp": strategy.mesh.size(),
        "dp": 1 if dp is None else dp.group.size(),
        "plan": dict(strategy.plan),
        "split": {
            name: placement[0].dim
            for name, placement in strategy.placements.items()
            if placement and placement[0].is_shard()
        },
    }


def check_resume(saved_metadata: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise :class:`LayoutMismatchError` when a checkpoint's global batch differs from this run's.

    Example:
        >>> check_resume(layout(16, 2), layout(32, 1))  # same global batch: fine
        >>> check_resume(layout(16, 2), layout(16, 1))  # doctest: +SKIP
        LayoutMismatchError: ... global batch of 32 ..., this run has 16 ...: use batch_size=32 per rank ...
    """
    saved = (saved_metadata or {}).get("data_parallel")
    now = (current or {}).get("data_parallel")
    if not saved or not now or saved["global_batch_size"] == now["global_batch_size"]:
        return
    per_rank, remainder = divmod(saved["global_batch_size"], now["world_size"])
    fix = (
        f"use batch_size={per_rank} per rank with {now['world_size']} process(es)"
        if remainder == 0
        else f"use a world size that divides {saved['global_batch_size']}"
    )
    raise LayoutMismatchError(
        f"the checkpoint was written with a global batch of {saved['global_batch_size']} examples per step "
        f"({saved['world_size']} process(es) x {saved['batch_size']}), this run has "
        f"{now['global_batch_size']} ({now['world_size']} x {now['batch_size']}); its data position counts "
        f"global steps, so it is valid only with the same global batch: {fix}"
    )
