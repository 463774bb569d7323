"""Importable model and datasets for Trainer/CLI tests (config files name them as import specs)."""

from __future__ import annotations

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
