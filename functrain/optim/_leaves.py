"""Internal helpers shared by the transforms: leaf lists that match, state scalars, argument checks."""

from __future__ import annotations

import math
from typing import Any

import torch

from functrain import tree
from functrain.tree import PyTree


def flatten_matching(
    who: str, updates: PyTree, *state_trees: PyTree
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], Any]:
    """Leaves of ``updates`` and of each state tree, checked to have the same structure.

    Returns ``(update_leaves, [state_leaves, ...], treespec)``; the treespec rebuilds a tree like
    ``updates``. A mismatch means the gradients are not shaped like the params given to ``init``.
    """
    leaves, spec = tree.flatten(updates)
    others = []
    for state_tree in state_trees:
        state_leaves, state_spec = tree.flatten(state_tree)
        if not tree.same_structure(state_spec, spec):
            raise ValueError(
                f"{who}: the updates do not match the optimizer state made by init(params): "
                f"{describe_mismatch(updates, state_tree)}. Call init with the same params tree the "
                "gradients come from (same names, same frozen leaves)."
            )
        others.append(state_leaves)
    return leaves, others, spec


def describe_mismatch(a: PyTree, b: PyTree, a_name: str = "updates", b_name: str = "state") -> str:
    """A short human description of how two trees differ (missing and extra leaf paths)."""
    a_paths, b_paths = tree.paths(a), tree.paths(b)
    missing = [p for p in b_paths if p not in set(a_paths)]
    extra = [p for p in a_paths if p not in set(b_paths)]
    parts = []
    if missing:
        parts.append(f"leaves in {b_name} but not in {a_name}: {missing[:5]}")
    if extra:
        parts.append(f"leaves in {a_name} but not in {b_name}: {extra[:5]}")
    if not parts:
        parts.append(f"same leaf paths but different structure ({tree.structure(a)} vs {tree.structure(b)})")
    return "; ".join(parts)


def device_of(params: PyTree) -> torch.device:
    """Where the optimizer's scalars live: beside the first parameter, so no step mixes devices."""
    for leaf in tree.leaves(params):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def zero_count(params: PyTree) -> torch.Tensor:
    """A 0-d int64 step counter on the params' device."""
    return torch.zeros((), dtype=torch.int64, device=device_of(params))


def scalar_dtype(params: PyTree) -> torch.dtype:
    """The dtype of the hyperparameters an optimizer keeps for these params: float64 when any leaf is
    float64, so float64 training applies them as torch.optim does (in double); else float32 (float32, bf16
    and fp16 params alike, as before). A float32 or bf16 leaf multiplied by a float64 0-d tensor stays in
    its own dtype (the scalar is rounded to it once)."""
    if any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in tree.leaves(params)):
        return torch.float64
    return torch.float32


def scalar(value: float | torch.Tensor, params: PyTree, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 0-d tensor holding ``value`` on the params' device (a hyperparameter in the state), of
    :func:`scalar_dtype` unless ``dtype`` is given."""
    dtype = scalar_dtype(params) if dtype is None else dtype
    return torch.as_tensor(value, dtype=dtype, device=device_of(params)).detach().clone().reshape(())


def check_real(who: str, name: str, value: Any) -> float:
    """``value`` as a float, or a TypeError naming the argument."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)  # build time only, never inside a step
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{who}: {name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{who}: {name} must be finite, got {value}")
    return value


def check_range(who: str, name: str, value: Any, low: float, high: float, *, high_open: bool = True) -> float:
    """``value`` as a float in ``[low, high)`` (or ``[low, high]``), or a ValueError naming the argument."""
    value = check_real(who, name, value)
    ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{who}: {name} must be in [{low}, {high}{bracket}, got {value}")
    return value


def check_nonnegative(who: str, name: str, value: Any) -> float:
    value = check_real(who, name, value)
    if value < 0:
        raise ValueError(f"{who}: {name} must be >= 0, got {value}")
    return value
