"""Which submodules are ZeRO-3's blocks: what ``fully_shard(blocks=...)`` accepts, checked and resolved.

The blocks' gathering forward is :mod:`functrain.distributed.blocks`; this module is below
:mod:`functrain.distributed.sharding`, which checks the request when it is made.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)]))
    >>> block_names(model, "auto")
    ('0.0', '0.1', '0.2')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["Blocks", "block_names", "check_blocks", "unknown_block_names"]

# What fully_shard(blocks=...) accepts: "auto", module classes, names (of submodules or of module
# classes, as Hugging Face's transformer_layer_cls_to_wrap), or a predicate.
Blocks = str | type | Sequence[type | str] | Callable[[str, nn.Module], bool] | None


def _auto(model: nn.Module) -> list[str]:
    """The entries of every ``nn.ModuleList`` holding 2+ modules of one class (a transformer's layers)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                found += [f"{name}.{i}" if name else str(i) for i in range(len(module))]
    return found


def _matches(blocks: Blocks) -> Callable[[str, nn.Module], bool]:
    if callable(blocks) and not isinstance(blocks, type):
        return blocks
    items = (blocks,) if isinstance(blocks, (str, type)) else tuple(blocks or ())
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                "fully_shard: blocks must be 'auto', module classes, submodule names or a predicate "
                f"(name, module) -> bool, got an item {item!r}"
            )
    classes = tuple(i for i in items if isinstance(i, type))
    names = {i for i in items if isinstance(i, str)}
    return lambda name, module: (
        name in names or type(module).__name__ in names or (bool(classes) and isinstance(module, classes))
    )


def check_blocks(blocks: Blocks) -> None:
    """Raise ``TypeError`` unless ``blocks`` is a valid ``fully_shard(blocks=...)`` value."""
    if blocks is not None and blocks != "auto":
        _matches(blocks)


def unknown_block_names(model: nn.Module, blocks: Blocks) -> list[str]:
    """The names in ``blocks`` that are neither a submodule of ``model`` nor the class name of one.

    Example:
        >>> import torch
        >>> unknown_block_names(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0", "Linear", "Layer"])
        ['Layer']
    """
    if not isinstance(blocks, (list, tuple)):
        return []
    known = {n for n, _ in model.named_modules() if n} | {type(m).__name__ for m in model.modules()}
    return sorted(n for n in blocks if isinstance(n, str) and n not in known)


def block_names(model: nn.Module, blocks: Blocks) -> tuple[str, ...]:
    """The submodules of ``model`` that ``blocks`` selects, outermost only (a block inside a block is
    part of it), in module order. ``"auto"``: the entries of each ``nn.ModuleList`` of 2+ modules of one
    class; none found: ``()``.

    Example:
        >>> import torch
        >>> block_names(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.nn.Linear)
        ('0',)
    """
    if blocks is None:
        return ()
    if blocks == "auto":
        chosen = set(_auto(model))
    else:
        match = _matches(blocks)
        chosen = {name for name, m in model.named_modules() if name and match(name, m)}
        missing = unknown_block_names(model, blocks)
        if missing:
            raise ValueError(
                f"fully_shard: blocks names {missing} are not submodules of the model, nor their class names"
            )
    outer = [n for n, _ in model.named_modules() if n in chosen]
    return tuple(n for n in outer if not any(n.startswith(o + ".") for o in outer if o != n))
