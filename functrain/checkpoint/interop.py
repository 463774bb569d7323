"""Export a state's weights to a torch state_dict or safetensors, for plain ``nn.Module`` users.

Tied parameters are stored once in a train state; the exported state_dict lists them under every name
(from ``{"tied_parameters": {alias: canonical}}`` metadata), so ``load_state_dict(strict=True)`` works.

Example:
    >>> import torch
    >>> state_dict = to_state_dict({"params": {"w": torch.ones(2)}, "buffers": {}}, tied_parameters={"v": "w"})
    >>> sorted(state_dict), state_dict["v"] is state_dict["w"]
    (['v', 'w'], True)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch

from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.placed import gather_placed
from functrain.checkpoint.sources import checkpoint_weights, import_safetensors
from functrain.core.atomic import atomic_write, temporary_path

__all__ = ["export", "to_state_dict"]


def _group(state: Any, group: str) -> Mapping[str, torch.Tensor]:
    value = state.get(group) if isinstance(state, Mapping) else getattr(state, group, None)
    if not isinstance(value, Mapping):
        raise CheckpointError(
            f"to_state_dict needs a state with a {group!r} dict (a TrainState, or a restored checkpoint "
            f"dict); got {type(state).__qualname__}"
        )
    return value


def to_state_dict(state: Any, *, tied_parameters: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """``params`` and ``buffers`` as one flat state_dict, with each tied alias naming its canonical tensor.

    ``state`` is a TrainState-like struct or a dict with ``"params"`` and ``"buffers"`` (what
    :func:`functrain.checkpoint.restore` returns without a target).

    A tensor-parallel state gives whole tensors (gathered: every rank of its mesh calls it).

    Example:
        >>> module.load_state_dict(to_state_dict(state), strict=True)  # doctest: +SKIP
    """
    state, _ = gather_placed(state)
    state_dict = {**_group(state, "params"), **_group(state, "buffers")}
    for alias, canonical in (tied_parameters or {}).items():
        if canonical not in state_dict:
            raise CheckpointError(
                f"tied parameter {alias!r} points to {canonical!r}, which is not among the state's params "
                "or buffers; fix the 'tied_parameters' metadata"
            )
        state_dict[alias] = state_dict[canonical]
    return state_dict


def export(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    format: Literal["pt", "safetensors"] = "pt",
) -> dict[str, torch.Tensor]:
    """Write the weights of a functrain checkpoint to ``output`` as a torch.save file or safetensors.

    Only ``params`` and ``buffers`` are read (tied aliases come from the checkpoint's metadata); the file
    is written atomically. ``checkpoint`` must be a functrain checkpoint: pickles and torch.save files are
    refused, never unpickled. Safetensors cannot store shared tensors, so there a tied alias is a copy.
    Returns the exported state_dict.

    Example:
        >>> export("run/step_00001000.ckpt", "model.safetensors", format="safetensors")  # doctest: +SKIP
    """
    weights, metadata = checkpoint_weights(checkpoint)
    tied = metadata.get("tied_parameters") or {}
    if not isinstance(tied, Mapping):
        raise CheckpointError(f"{os.fspath(checkpoint)}: metadata 'tied_parameters' must be a dict of names")
    state_dict = to_state_dict({"params": weights, "buffers": {}}, tied_parameters=tied)
    if format == "pt":
        with atomic_write(output) as file:
            torch.save(state_dict, file)
    elif format == "safetensors":
        safetensors_torch = import_safetensors()
        unshared = {name: (t.clone() if name in tied else t.contiguous()) for name, t in state_dict.items()}
        # save_file takes a path, not a file object: write beside the output and rename, as atomic_write does.
        temporary = temporary_path(output)
        try:
            safetensors_torch.save_file(unshared, temporary)
            os.replace(temporary, output)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
    else:
        raise CheckpointError(f"format={format!r}: export writes 'pt' or 'safetensors'")
    return state_dict
