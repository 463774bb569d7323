"""Partial restore for fine-tuning: load the weights that match by name and shape into a new state.

Example:
    >>> state, report = init_weights_from("pretrained/step_00010000.ckpt", state)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    loaded 14, skipped 2, left at initial value 2
      skipped head.weight: shape [1000, 512] in source, [10, 512] in target
      ...
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.placed import strategy_of
from functrain.checkpoint.sources import load_weights

__all__ = ["InitReport", "init_weights_from"]

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class InitReport:
    """What :func:`init_weights_from` did, by parameter/buffer name.

    ``loaded``: copied from the source (``cast`` lists those converted to the target's dtype);
    ``skipped``: source entries not used, with the reason; ``initial``: target entries left at their
    initial value (not in the source, or of another shape there).

    Example:
        >>> InitReport(loaded=["fc.weight"], initial=["head.weight"]).complete
        False
    """

    loaded: list[str] = dataclasses.field(default_factory=list)
    cast: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    initial: list[str] = dataclasses.field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every target entry was loaded and every source entry used."""
        return not self.skipped and not self.initial

    def __str__(self) -> str:
        lines = [
            f"loaded {len(self.loaded)}, skipped {len(self.skipped)}, left at initial value {len(self.initial)}"
        ]
        lines += [f"  cast {name}: {how}" for name, how in self.cast.items()]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        lines += [f"  left at initial value: {name}" for name in self.initial]
        return "\n".join(lines)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def init_weights_from(
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    state: S,
    *,
    strict: bool = False,
    key_map: Callable[[str], str | None] | None = None,
    tied_parameters: Mapping[str, str] | None = None,
) -> tuple[S, InitReport]:
    """Copy the source's weights that match ``state.params`` / ``state.buffers`` by name and shape.

    ``source`` is a functrain checkpoint (its ``params`` and ``buffers``; the optimizer state is not
    read), a ``torch.save`` state_dict, a safetensors file, or a ``{name: tensor}`` mapping. ``state`` is
    any struct with ``params`` and ``buffers`` dicts and ``replace``; the result keeps its devices and
    dtypes (a different dtype in the source is cast, and reported). ``key_map`` renames source keys
    (return ``None`` to drop one); alias keys of ``tied_parameters`` (``{alias: canonical}``, read from a
    functrain checkpoint's metadata when not given) are not counted as unused. With ``strict=True``
    anything skipped or left at its initial value raises a CheckpointError carrying the report. A
    tensor-parallel state (``tp.place(state)``) is filled whole and placed again: every rank calls it.

    Example:
        >>> new_state, report = init_weights_from("backbone.safetensors", state)  # doctest: +SKIP
        >>> report.initial  # doctest: +SKIP
        ['head.bias', 'head.weight']
    """
    strategy = strategy_of(state)
    if strategy is not None:  # tensor parallelism: filled whole, placed again (collective)
        whole, report = init_weights_from(
            source, strategy.gather(state), strict=strict, key_map=key_map, tied_parameters=tied_parameters
        )
        return strategy.place(whole), report
    for group in ("params", "buffers"):
        if not isinstance(getattr(state, group, None), Mapping):
            raise CheckpointError(
                f"init_weights_from needs a state with a {group!r} dict (a functrain TrainState); "
                f"got {type(state).__qualname__}"
            )
    params: Mapping[str, torch.Tensor] = state.params  # type: ignore[attr-defined]
    buffers: Mapping[str, torch.Tensor] = state.buffers  # type: ignore[attr-defined]
    target = {**params, **buffers}

    def renamed(name: str) -> str | None:
        return key_map(name) if key_map is not None else name

    metadata: dict[str, Any] = {}
    if isinstance(source, Mapping):
        weights = dict(source)
    else:
        weights, metadata = load_weights(source)
    aliases = set(
        (tied_parameters if tied_parameters is not None else metadata.get("tied_parameters") or {}).keys()
    )

    report = InitReport()
    found: dict[str, torch.Tensor] = {}
    for source_name, tensor in weights.items():
        name = renamed(source_name)
        if name is None:
            report.skipped[source_name] = "dropped by key_map"
        elif name not in target:
            if source_name not in aliases:
                report.skipped[source_name] = "not in the target"
        elif tuple(tensor.shape) != tuple(target[name].shape):
            report.skipped[source_name] = (
                f"shape {_shape(tensor)} in source, {_shape(target[name])} in target"
            )
        else:
            found[name] = tensor

    def fill(group: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, old in group.items():
            new = found.get(name)
            if new is None:
                report.initial.append(name)
                out[name] = old
                continue
            if new.dtype != old.dtype:
                report.cast[name] = f"{new.dtype} -> {old.dtype}"
            # A caller's own tensors are copied: a donating step would otherwise write into them.
            out[name] = new.detach().to(device=old.device, dtype=old.dtype, copy=isinstance(source, Mapping))
            report.loaded.append(name)
        return out

    new_state = state.replace(params=fill(params), buffers=fill(buffers))  # type: ignore[attr-defined]
    if strict and not report.complete:
        raise CheckpointError(
            f"strict init_weights_from: the source does not match the state exactly:\n{report}"
        )
    return new_state, report
