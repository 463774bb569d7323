"""Small models shared by the tests (an MLP, a CNN with BatchNorm and dropout, a tied-weights LM, a tiny
transformer)."""

from __future__ import annotations

import torch
from torch import nn


def mlp(d_in: int = 8, hidden: int = 16, d_out: int = 3, dropout: float = 0.0) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(hidden, d_out)]
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4, dropout: float = 0.2) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x).flatten(1)))


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight (registered as embed.weight and
    out.weight), and a non-persistent buffer."""

    def __init__(self, vocab: int = 5, d_model: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 11, d_model: int = 16, classes: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 2, 32, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def classification_batch(n: int = 16, d_in: int = 8, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g)
