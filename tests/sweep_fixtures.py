"""Importable model and digits datasets for the sweep tests (config files name them as import specs)."""

from __future__ import annotations

import torch
from torch import nn


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def digits(split: str = "train", n: int | None = None) -> torch.utils.data.TensorDataset:
    from functrain.trainer.demo import digits_splits

    index = {"train": 0, "val": 1, "test": 2}[split]
    dataset = digits_splits(0)[index]
    if n is not None:
        dataset = torch.utils.data.TensorDataset(*(t[:n] for t in dataset.tensors))
    return dataset
