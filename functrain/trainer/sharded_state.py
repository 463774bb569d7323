"""``Trainer.load`` onto a sharded state (``config.sharding``): from a sharded checkpoint of the run's
folder (``step_N.shards``, any saved world size and level) or from one whole file (``Trainer.save``,
a replicated run's checkpoint).

Example:
    >>> state = load(trainer.state, "runs/a/checkpoints/step_0000000008.shards")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from functrain import checkpoint
from functrain.checkpoint import sharded
from functrain.checkpoint.onto import restore_onto
from functrain.core.tree_walk import rebuild
from functrain.distributed.sharding import ShardLayout, local_rows

__all__ = ["load"]

_STEP_DIR = re.compile(r"^step_(\d+)\.shards$")


def load(state: Any, path: str | os.PathLike[str]) -> Any:
    """``state`` (sharded) with the checkpoint at ``path``: its rows for this rank. Collective: every
    rank calls it. A whole file is restored onto the gathered state, then cut to this rank's rows (the
    full state exists for that moment); a sharded checkpoint is read rows by rows."""
    layout: ShardLayout = state.layout
    folder = Path(path)
    if folder.name == sharded.MANIFEST:
        folder = folder.parent
    found = _STEP_DIR.match(folder.name)
    if found is not None and folder.is_dir():
        raw = sharded.restore_sharded(folder.parent, step=int(found.group(1)), sharding=layout.request)
        return restore_onto(state, raw.get("state", raw) if isinstance(raw, dict) else raw)
    raw = checkpoint.restore(path)
    raw = raw.get("state", raw) if isinstance(raw, dict) else raw
    cut = layout.sharded_leaves(state)
    whole = restore_onto(layout.full_state(state), raw)

    def leaf(where: tuple[Any, ...], x: Any) -> Any:
        return local_rows(x, layout.request).clone() if where in cut else x

    return rebuild(whole, leaf).replace(layout=layout)
