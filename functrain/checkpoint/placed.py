"""Checkpoints of a tensor-parallel state (params and moments as DTensors on a tp or dp x tp mesh).

A tensor-parallel state is saved **whole**: every rank gathers it through its strategy
(``TensorParallel.gather``, a collective), and the file holds plain tensors, the same bytes one process
training on the same global batches would hold. So it loads on any layout: one process, another tp size,
another dp x tp grid. Restoring onto a tensor-parallel target reads the whole tensors on every rank and
places them through the *target's* strategy (``TensorParallel.place``: each rank keeps its part). The
header's metadata records the layout the file was written with
(``{"tensor_parallel": {"state": {"tp": 2, "dp": 2, "plan": {...}, "split": {...}}}}``), and a restore
that does not match names it, so a mismatch is explained rather than blamed on the layout.

Memory: the save holds, on every rank and for the duration of the write, the whole state (params and
every optimizer moment, as one process holds them) beside the rank's own parts; a restore holds the whole
tensors read from the file until they are placed. At the peak that is the replicated state's bytes plus
the rank's 1/tp parts, on every rank. (Gathering leaf by leaf onto the writer alone would bound it by the
largest leaf; not done yet.)

Example:
    >>> import torch
    >>> gather_placed({"w": torch.ones(2)})  # no tensor-parallel state inside: unchanged, no metadata
    ({'w': tensor([1., 1.])}, {})
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from functrain import tree
from functrain.core.tree_walk import Path, children, rebuild_node
from functrain.distributed.layout import TENSOR_PARALLEL, tensor_parallel_layout

__all__ = [
    "describe_saved_layout",
    "gather_placed",
    "place_restored",
    "placed_states",
    "strategy_of",
    "whole_targets",
]


def _strategy_type() -> type | None:
    """``TensorParallel`` when its module is loaded (no tensor-parallel state can exist before that: its
    import, DTensor's, takes seconds and is not made here)."""
    module = sys.modules.get("functrain.distributed.tensor_parallel")
    return getattr(module, "TensorParallel", None)


def strategy_of(state: Any) -> Any | None:
    """The ``TensorParallel`` strategy ``state`` is placed by (its ``layout``), else ``None``.

    Example:
        >>> strategy_of({"w": 1}) is None
        True
    """
    strategy = _strategy_type()
    layout = getattr(state, "layout", None)
    return layout if strategy is not None and isinstance(layout, strategy) else None


def _map_placed(obj: Any, fn: Callable[[Path, Any], Any]) -> Any:
    """``obj`` with every state whose ``layout`` is a ``TensorParallel`` replaced by ``fn(path, state)``,
    wherever it sits (the state itself, or inside containers: ``fit`` saves ``{"state": ..., "loop": ...}``)."""
    if _strategy_type() is None:
        return obj

    def walk(node: Any, path: Path) -> Any:
        if strategy_of(node) is not None:
            return fn(path, node)
        found = children(node)
        if found is None:
            return node
        kind, items = found
        return rebuild_node(node, kind, items, [walk(child, (*path, key)) for key, child in items])

    return walk(obj, ())


def placed_states(obj: Any) -> list[tuple[Path, Any]]:
    """``(path, state)`` of every tensor-parallel state in ``obj``.

    Example:
        >>> placed_states({"step": 3})
        []
    """
    found: list[tuple[Path, Any]] = []

    def note(path: Path, state: Any) -> Any:
        found.append((path, state))
        return state

    _map_placed(obj, note)
    return found


def gather_placed(obj: Any) -> tuple[Any, dict[str, Any]]:
    """``obj`` with every tensor-parallel state gathered whole (plain tensors, ``layout=None``), and the
    metadata that records each one's layout by its path (``"state"`` for ``obj`` itself). Collective:
    every rank of each state's mesh calls it.

    Example:
        >>> whole, metadata = gather_placed({"state": tp_state, "loop": loop})  # doctest: +SKIP
        >>> metadata["tensor_parallel"]["state"]["tp"]  # doctest: +SKIP
        2
    """
    layouts: dict[str, Any] = {}

    def gather(path: Path, state: Any) -> Any:
        layouts[tree.path_str(path) if path else "state"] = tensor_parallel_layout(state.layout)
        return state.layout.gather(state)

    whole = _map_placed(obj, gather)
    return whole, ({TENSOR_PARALLEL: layouts} if layouts else {})


def whole_targets(target: Any) -> Any:
    """``target`` with every tensor-parallel state gathered whole but keeping its ``layout``: what a
    restore checks a checkpoint's whole tensors against (a ZeRO state keeps row pieces, of other shapes)
    before :func:`place_restored` places them. Collective.

    Example:
        >>> whole_targets({"w": 1})  # no tensor-parallel state inside: unchanged
        {'w': 1}
    """
    return _map_placed(target, lambda _, state: state.layout.gather(state).replace(layout=state.layout))


def place_restored(restored: Any) -> Any:
    """``restored`` (plain whole tensors in a target's structure, each tensor-parallel state keeping the
    target's ``layout``) with every such state placed by its strategy. Collective.

    Example:
        >>> state = place_restored(restore_onto_plain(tp_state, raw))  # doctest: +SKIP
    """
    return _map_placed(restored, lambda _, state: state.layout.place(state.replace(layout=None)))


def describe_saved_layout(metadata: Mapping[str, Any]) -> str:
    """What a checkpoint's metadata says about the tensor-parallel layout it was written with (``""``
    when it was not written by one).

    Example:
        >>> describe_saved_layout({"tensor_parallel": {"state": {"tp": 2, "dp": 2, "plan": {"*.fc": "colwise"}}}})
        "it was written by a tensor-parallel run (state: tp=2 x dp=2, plan {'*.fc': 'colwise'}) and holds whole tensors, which load onto any layout: the mismatch is in the model or the optimizer, not in the layout"
    """
    layouts = metadata.get(TENSOR_PARALLEL) if isinstance(metadata, Mapping) else None
    if not isinstance(layouts, Mapping) or not layouts:
        return ""
    parts = [
        f"{path}: tp={entry.get('tp')} x dp={entry.get('dp')}, plan {entry.get('plan')}"
        for path, entry in layouts.items()
        if isinstance(entry, Mapping)
    ]
    return (
        f"it was written by a tensor-parallel run ({'; '.join(parts)}) and holds whole tensors, which load "
        "onto any layout: the mismatch is in the model or the optimizer, not in the layout"
    )
