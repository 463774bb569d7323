"""The loop's data plumbing: loaders from what ``fit``/``evaluate``/``predict`` are given, the run's data
key, one host sync for many scalars, and notes naming the step a failed batch was for."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from functrain import distributed, random
from functrain.data.build import as_loader
from functrain.data.notes import add_note
from functrain.ensemble.stacked import run_key

__all__ = ["as_loader", "batch_device", "data_key", "gathered", "noting_steps", "scalar_dict"]

_DATA_KEY = 0xDA7A


def data_key(state: Any) -> torch.Tensor:
    """The key that orders a run's training data (shuffling): one function of the run's key, shared by
    ``fit`` and the Trainer so that both feed a run the same batches."""
    return random.fold_in(run_key(state), _DATA_KEY)


def gathered(value: Any) -> list[Any]:
    """``value`` from every rank, by rank (``[value]`` in one process); every rank calls it together.

    Example:
        >>> gathered({"position": 3})
        [{'position': 3}]
    """
    if not distributed.is_distributed() or distributed.world_size() == 1:
        return [value]
    values: list[Any] = [None] * distributed.world_size()
    torch.distributed.all_gather_object(values, value)  # in memory only: nothing read back from a file
    return values


def batch_device(state: Any) -> torch.device | None:
    """Where the step wants its batches: the state's accelerator, or ``None`` (leave them as they are)."""
    device = getattr(state, "device", None)
    return device if isinstance(device, torch.device) and device.type != "cpu" else None


def scalar_dict(values: Mapping[str, Any]) -> dict[str, float]:
    """Tensors -> floats with a single device sync."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if names:
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in names]).cpu().tolist()
        out.update(zip(names, stacked))
    return out


def noting_steps(stream: Iterator[Any], next_step: Callable[[], int]) -> Iterator[Any]:
    """``stream`` as it is, but an error raised while loading a batch leaves with a note naming the
    training step that batch was for (the Loader's own note names its epoch and batch)."""
    try:
        yield from stream
    except Exception as error:  # a generator sees only its source's errors, never the loop body's
        add_note(error, f"functrain.fit: loading the batch of training step {next_step()}")
        raise
