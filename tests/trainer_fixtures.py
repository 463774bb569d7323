"""Importable model and datasets for Trainer/CLI tests (config files name them as import specs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self, d_in: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_dataset(n: int = 120, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return torch.utils.data.TensorDataset(x, y)


def quiet_config(tmp_path: Path, **fields: Any) -> Any:
    """A ``TrainerConfig`` for a small eager CPU run in ``tmp_path / "run"`` with no progress bar or
    summary table, batch size 16; ``fields`` add to or override these."""
    import functrain as ft

    defaults: dict[str, Any] = {
        "output_dir": str(tmp_path / "run"),
        "batch_size": 16,
        "compile": False,
        "progress_bar": False,
        "print_summary": False,
        "device": "cpu",
    }
    return ft.TrainerConfig(**{**defaults, **fields})
