"""The model, data and config of the tensor-parallel Trainer tests (``test_tensor_parallel_trainer.py``):
importable by name from a YAML config (``model: tp_trainer_fixtures:gpt``) and by the torchrun worker."""

from __future__ import annotations

import os
from typing import Any

import torch
import tp_worker

import functrain as ft


class LastTokenGPT(tp_worker.GPT):
    """``tp_worker``'s two-block GPT (``GPT_PLAN``'s names), classifying a sequence by its last position:
    ``(batch, vocab)`` logits, so the default criterion and ``accuracy`` apply."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens)[:, -1]


class Seen(ft.metrics.Accuracy):
    """A sum-type metric: the number of examples trained on (Accuracy's ``"sum"``-reduced count)."""

    def compute(self, state: Any) -> torch.Tensor:
        return state.count.double()


def gpt(seed: int = 0) -> LastTokenGPT:
    """The model in float64, its weights from ``seed``."""
    torch.manual_seed(seed)
    return LastTokenGPT().double()


def tokens(n: int = 48, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` random sequences, each labelled by a function of its tokens (learnable)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, tp_worker.VOCAB, (n, tp_worker.SEQ), generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] + x[:, -1]) % tp_worker.VOCAB)


def config(output_dir: str, **fields: Any) -> ft.TrainerConfig:
    """2 epochs of AdamW with clipping (active) and weight decay, evaluated each epoch, no checkpoints."""
    base: dict[str, Any] = dict(
        output_dir=os.fspath(output_dir), epochs=2, batch_size=8, seed=5, compile=False, device="cpu",
        optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}, max_grad_norm=0.5,
        metrics=["accuracy"], save_strategy="no", progress_bar=False, print_summary=False,
    )  # fmt: skip
    return ft.TrainerConfig(**{**base, **fields})


def gradients(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Whole float64 gradients of the params' ``shapes``, the same in every process (norm > 0.5:
    ``config``'s clipping acts)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64) for k, shape in sorted(shapes.items())}
