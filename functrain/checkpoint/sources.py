"""Read a flat ``{name: tensor}`` mapping of weights from any supported file, without pickle.

Supported: a functrain checkpoint (its ``params`` and ``buffers``, or its top-level tensors), a
``torch.save`` state_dict (read with ``torch.load(weights_only=True)``, which refuses arbitrary objects),
and a safetensors file (needs the optional ``safetensors`` package).

Example:
    >>> weights = load_state_dict("pretrained.safetensors")  # doctest: +SKIP
    >>> sorted(weights)[:2]  # doctest: +SKIP
    ['fc.bias', 'fc.weight']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from functrain.checkpoint import format as fmt
from functrain.checkpoint import structure
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.file import open_for_reading
from functrain.core.tree_walk import Path

__all__ = ["checkpoint_weights", "import_safetensors", "load_state_dict", "weight_name"]

PathLike = str | os.PathLike[str]
_WEIGHT_GROUPS = ("params", "buffers")


def import_safetensors() -> Any:
    """The ``safetensors.torch`` module, or a CheckpointError saying how to install it."""
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError(
            "safetensors is not installed; install it with `pip install safetensors` "
            "(or `pip install functrain[safetensors]`)"
        ) from None
    return safetensors.torch


def weight_name(path: Path) -> str | None:
    """The parameter/buffer name a checkpoint path holds: ``("params", "fc.weight")`` -> ``"fc.weight"``.

    ``fit`` saves ``{"state": train_state, "loop": ...}``, so ``("state", "params", name)`` counts too.
    """
    if len(path) == 3 and path[0] == "state":
        path = path[1:]
    if len(path) == 2 and path[0] in _WEIGHT_GROUPS and isinstance(path[1], str):
        return path[1]
    return None


def checkpoint_weights(
    path: PathLike, wanted: Callable[[str], bool] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights (``params`` and ``buffers``, or top-level tensors) and metadata of a functrain checkpoint.

    Anything else, a pickle or torch.save file included, is refused with a :class:`CheckpointError`.

    Example:
        >>> weights, metadata = checkpoint_weights("run/step_00001000.ckpt")  # doctest: +SKIP
    """
    name = os.fspath(path)
    wanted = wanted or (lambda _: True)
    with open_for_reading(path) as file:
        header = fmt.read_header(file, name=name)
        leaves: list[tuple[Path, Any]] = []
        structure.decode(header.tree, header.tensors, leaves=leaves, name=name)
        tensor_leaves = [(p, v) for p, v in leaves if isinstance(v, fmt.TensorInfo)]
        names = [weight_name(p) for p, _ in tensor_leaves]
        if not any(names):  # a plain {name: tensor} dict saved with functrain
            names = [p[0] if len(p) == 1 and isinstance(p[0], str) else None for p, _ in tensor_leaves]
        name_of = {id(info): n for (_, info), n in zip(tensor_leaves, names)}
        index_name = [name_of[id(info)] for info in header.tensors]
        out: dict[str, torch.Tensor] = {}
        selected = fmt.read_tensors(
            file, header, name=name, select=lambda i, _: index_name[i] is not None and wanted(index_name[i])
        )
        for index, tensor in selected:
            if tensor is not None:
                out[index_name[index]] = tensor
    return out, header.metadata


def load_state_dict(
    path: PathLike, *, wanted: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` on the CPU from a functrain checkpoint, a torch.save file or safetensors.

    ``wanted(name)`` limits which tensors a functrain checkpoint reads (the others are skipped on disk).

    Example:
        >>> load_state_dict("run/step_00001000.ckpt")["fc.weight"].shape  # doctest: +SKIP
        torch.Size([10, 64])
    """
    return load_weights(path, wanted=wanted)[0]


def load_weights(
    path: PathLike, *, wanted: Callable[[str], bool] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Like :func:`load_state_dict`, also returning the checkpoint's metadata (empty for other formats)."""
    name = os.fspath(path)
    with open_for_reading(path, "weights file") as file:
        start = file.read(len(fmt.MAGIC))
    if start == fmt.MAGIC:
        return checkpoint_weights(path, wanted)
    if name.endswith(".safetensors") or start[8:9] == b"{":
        try:
            weights = import_safetensors().load_file(name, device="cpu")
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(f"{name}: not a readable safetensors file: {error}") from error
    else:
        try:
            weights = torch.load(name, map_location="cpu", weights_only=True)
        except Exception as error:
            # weights_only refuses anything but tensors (UnpicklingError), or a bad file.
            # torch's own message is left out on purpose: it advises weights_only=False, which runs the code.
            raise CheckpointError(
                f"{name}: not a functrain checkpoint, a safetensors file or a torch.save file of plain tensors "
                f"(torch.load(weights_only=True) refused it with {type(error).__name__}). If it is a pickle "
                f"holding more than tensors, {fmt.REFUSED_PICKLE}"
            ) from None
    _check_flat(weights, name)
    return dict(weights), {}


def _check_flat(weights: Any, name: str) -> None:
    if not isinstance(weights, Mapping):
        raise CheckpointError(
            f"{name}: holds a {type(weights).__qualname__}, expected a {{name: tensor}} state_dict"
        )
    for key, value in weights.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{name}: entry {key!r} is a {type(value).__qualname__}; a state_dict maps names to tensors "
                "(for a training checkpoint dict, pass its 'state_dict' / 'model' entry)"
            )
