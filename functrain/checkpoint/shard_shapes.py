"""The whole shapes of a sharded state's leaves, for restoring onto it and for reporting a mismatch.

Below both :mod:`.onto` (which names whole shapes in a mismatch) and :mod:`.sharded` (which saves and
restores the shards).

Example:
    >>> import torch
    >>> sharded_leaves({"w": torch.zeros(2)})  # no sharded state inside: nothing is sharded
    {}
"""

from __future__ import annotations

from typing import Any

from functrain import tree
from functrain.core.tree_walk import Path
from functrain.distributed.sharding import ShardLayout

__all__ = ["WHOLE_SHAPE", "sharded_leaves", "sharded_states"]

# The saved leaf's global shape, set on the rows a plain restore with ``sharding=`` returns (this rank's
# block), so that ``restore_onto`` reports a mismatch in whole shapes ([12, 16] vs [14, 16]), not blocks.
WHOLE_SHAPE = "functrain_whole_shape"


def sharded_states(obj: Any, prefix: Path = ()) -> list[tuple[Path, Any]]:
    """``(path, state)`` of every sharded state in ``obj`` (the object itself, or inside dicts/lists:
    ``fit`` saves ``{"state": state, "loop": ...}``)."""
    if isinstance(getattr(obj, "layout", None), ShardLayout):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [found for k, v in obj.items() for found in sharded_states(v, (*prefix, k))]
    if isinstance(obj, list | tuple) and not tree.is_struct(obj):
        return [found for i, v in enumerate(obj) for found in sharded_states(v, (*prefix, i))]
    return []


def sharded_leaves(obj: Any) -> dict[Path, tuple[int, ...]]:
    """``{path: whole shape}`` of every sharded leaf of the sharded states in ``obj``."""
    return {
        (*prefix, *path): shape
        for prefix, state in sharded_states(obj)
        for path, shape in state.layout.sharded_leaves(state).items()
    }
