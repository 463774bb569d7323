"""Put a restored checkpoint's plain containers back onto a target tree: one check of every leaf.

Example:
    >>> import torch
    >>> raw = {"w": torch.ones(2), "step": 3}
    >>> restore_onto({"w": torch.zeros(2), "step": 0}, raw)
    {'w': tensor([1., 1.]), 'step': 3}
"""

from __future__ import annotations

from typing import Any

import torch

from functrain import tree
from functrain.checkpoint import structure
from functrain.checkpoint.structure import Path

__all__ = ["restore_onto"]


def restore_onto(target: Any, raw: Any, where: str = "state") -> Any:
    """``raw`` (what :func:`~functrain.checkpoint.restore` or ``CheckpointManager.restore`` return without a
    target: plain containers) in ``target``'s structure and container types, each tensor on the device of
    the target tensor it replaces; entries of ``raw`` that ``target`` lacks are left out.

    Every leaf is checked (present, a tensor where the target has one, same shape and dtype) and all
    mismatches are reported together, by path, in one ``ValueError``. ``where`` names ``target`` in them
    (``"state.params"`` when restoring only the parameters).

    Example:
        >>> state = restore_onto(state, manager.restore("best")["state"])  # doctest: +SKIP
    """
    problems: list[str] = []

    def leaf(node: Any, saved: Any, path: Path) -> Any:
        if node is None:
            return None  # nothing to restore into (a state without metrics keeps none)
        if isinstance(node, torch.Tensor):
            if not isinstance(saved, torch.Tensor):
                problems.append(
                    f"{where}.{tree.path_str(path)}: checkpoint holds {type(saved).__name__}, not a tensor"
                )
                return node
            if saved.shape != node.shape or saved.dtype != node.dtype:
                problems.append(
                    f"{where}.{tree.path_str(path)}: checkpoint {saved.dtype} {list(saved.shape)}, "
                    f"model {node.dtype} {list(node.shape)}"
                )
                return node
            return saved.to(node.device)
        return saved

    def walk(node: Any, saved: Any, path: Path) -> Any:
        found = structure.children(node)
        if found is None:
            return leaf(node, saved, path)
        kind, items = found
        values = []
        for i, (key, child) in enumerate(items):
            try:  # a named tuple comes back from a file as a plain tuple
                sub = saved[i] if kind == "namedtuple" and isinstance(saved, tuple | list) else saved[key]
            except (KeyError, IndexError, TypeError):
                if _has_leaves(child):
                    problems.append(f"missing in checkpoint: {where}.{tree.path_str((*path, key))}")
                values.append(child)
                continue
            values.append(walk(child, sub, (*path, key)))
        return structure.rebuild_node(node, kind, items, values)

    out = walk(target, raw, ())
    if problems:
        raise ValueError(
            "the checkpoint does not match this run's state (was it written for another model or "
            "optimizer?):\n  " + "\n  ".join(problems[:30])
        )
    return out


def _has_leaves(node: Any) -> bool:
    """Whether ``node`` holds anything to restore (``None`` and empty containers do not)."""
    return any(leaf is not None for _, leaf in structure.leaves_with_paths(node))
