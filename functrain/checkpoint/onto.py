"""Put a restored checkpoint's plain containers back onto a target tree: one check of every leaf.

Example:
    >>> import torch
    >>> raw = {"w": torch.ones(2), "step": 3}
    >>> restore_onto({"w": torch.zeros(2), "step": 0}, raw)
    {'w': tensor([1., 1.]), 'step': 3}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from functrain import tree
from functrain.checkpoint.placed import place_restored, whole_targets
from functrain.checkpoint.shard_shapes import WHOLE_SHAPE, sharded_leaves
from functrain.core.tree_walk import Path, children, leaves_with_paths, rebuild_node

__all__ = ["restore_onto"]


def restore_onto(target: Any, raw: Any, where: str = "state") -> Any:
    """``raw`` (what :func:`~functrain.checkpoint.restore` or ``CheckpointManager.restore`` return without a
    target: plain containers) in ``target``'s structure and container types, each tensor on the device of
    the target tensor it replaces; entries of ``raw`` that ``target`` lacks are left out.

    A tensor-parallel state in ``target`` (``tp.place(state)``) gets the whole tensors placed by its own
    strategy, whatever layout saved them (collective: every rank of its mesh calls ``restore_onto``).

    Every leaf is checked (present, a tensor where the target has one, same shape and dtype) and all
    mismatches are reported together, by path, in one ``ValueError``. ``where`` names ``target`` in them
    (``"state.params"`` when restoring only the parameters).

    Example:
        >>> state = restore_onto(state, manager.restore("best")["state"])  # doctest: +SKIP
    """
    problems: list[str] = []
    shapes: dict[Path, tuple[int, ...]] | None = None
    target = whole_targets(target)  # a tensor-parallel state's leaves as the whole tensors a file holds

    def whole_shapes(path: Path) -> tuple[int, ...] | None:
        nonlocal shapes
        if shapes is None:  # a shard's whole shape, looked up once something mismatches
            shapes = sharded_leaves(target)
        return shapes.get(path)

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
                problems.append(f"{where}.{tree.path_str(path)}: {_shapes(saved, node, whole_shapes(path))}")
                return node
            return saved.to(node.device)
        return saved

    def walk(node: Any, saved: Any, path: Path) -> Any:
        found = children(node)
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
        return rebuild_node(node, kind, items, values)

    out = walk(target, raw, ())
    if problems:
        hint = fit_checkpoint_hint(raw.keys() if isinstance(raw, dict) else (), target)
        hint = hint or "was it written for another model or optimizer?"
        raise ValueError(
            f"the checkpoint does not match this run's state ({hint}):\n  " + "\n  ".join(problems[:30])
        )
    return place_restored(out)  # a tensor-parallel target's whole tensors, placed as its strategy splits them


def fit_checkpoint_hint(saved_keys: Iterable[Any], target: Any, sharded: bool = False) -> str:
    """What to say when a file that ``fit`` wrote (``{"state": ..., "loop": ...}``) meets a bare state;
    ``""`` for any other mismatch.

    Example:
        >>> fit_checkpoint_hint(["state", "loop"], {"params": {}})[:50]
        "it is a fit checkpoint: it holds {'state', 'loop'}"
    """
    if not {"state", "loop"} <= set(saved_keys) or (isinstance(target, dict) and "state" in target):
        return ""
    how = (
        "restore_sharded(directory, target={'state': state})['state']"
        if sharded
        else "ft.checkpoint.restore_onto(state, ft.checkpoint.restore(path)['state'])"
    )
    return (
        "it is a fit checkpoint: it holds {'state', 'loop'}, the train state and the loop's position; "
        f"restore the train state with {how}"
    )


def _shapes(saved: torch.Tensor, node: torch.Tensor, whole: tuple[int, ...] | None) -> str:
    """``checkpoint float32 [12, 16], model float32 [14, 16]``: whole shapes first, then the rows this
    rank holds of each side that is a shard (a ZeRO state's, or a sharded checkpoint's)."""
    saved_whole = getattr(saved, WHOLE_SHAPE, None)
    text = f"checkpoint {saved.dtype} {list(saved_whole or saved.shape)}, "
    text += f"model {node.dtype} {list(whole or node.shape)}"
    rows = [f"checkpoint {list(saved.shape)}"] if saved_whole is not None else []
    rows += [f"model {list(node.shape)}"] if whole is not None else []
    return f"{text} (this rank's rows: {', '.join(rows)})" if rows else text


def _has_leaves(node: Any) -> bool:
    """Whether ``node`` holds anything to restore (``None`` and empty containers do not)."""
    return any(leaf is not None for _, leaf in leaves_with_paths(node))
