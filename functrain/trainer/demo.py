"""The built-in demo: a small CNN on scikit-learn's bundled digits (1,797 8x8 images), on the CPU.

``functrain demo`` trains with the Trainer facade — compiled step, progress bar, evaluation every epoch,
TensorBoard and JSONL logs, checkpoints — and prints the test accuracy. No download: the images ship
inside scikit-learn.

Example:
    >>> from functrain.trainer import demo
    >>> result = demo.run(output_dir="runs/demo", epochs=2)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DigitsCNN", "digits_splits", "run"]


class DigitsCNN(nn.Module):
    """Two conv blocks with BatchNorm, max-pooling, dropout and a linear head: 8x8x1 -> 10 classes."""

    def __init__(self, channels: int = 32, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * channels * 16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits_splits(seed: int = 0) -> tuple[Any, Any, Any]:
    """``(train, validation, test)`` datasets of ``(image[1, 8, 8] in [0, 1], label)`` pairs: 1257/180/360.

    Example:
        >>> train, val, test = digits_splits()
        >>> len(train), len(val), len(test)
        (1257, 180, 360)
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("the demo needs scikit-learn: pip install 'functrain[demo]'") from err
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    dataset = torch.utils.data.TensorDataset
    return (
        dataset(images[:1257], labels[:1257]),
        dataset(images[1257:1437], labels[1257:1437]),
        dataset(images[1437:], labels[1437:]),
    )


def config(output_dir: str = "runs/demo", **overrides: Any) -> Any:
    """The demo's TrainerConfig (any field can be overridden)."""
    from functrain.config import TrainerConfig

    fields: dict[str, Any] = {
        "output_dir": output_dir,
        "epochs": 12,
        "batch_size": 64,
        "eval_batch_size": 180,
        "drop_last": True,  # one batch shape: one compiled graph
        "seed": 0,
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 1e-4},
        "scheduler": {"name": "cosine", "warmup_ratio": 0.1},
        "criterion": {"name": "CrossEntropyLoss", "args": {"label_smoothing": 0.05}},
        "metrics": ["accuracy"],
        "metric_for_best_model": "accuracy",
        "load_best_model_at_end": True,
        "eval_strategy": "epoch",
        "save_strategy": "epoch",
        "save_total_limit": 2,
        "log_steps": 10,
        "tensorboard": True,
        "jsonl": True,
        "device": "cpu",
    }
    fields.update(overrides)
    return TrainerConfig.from_dict(fields)


def run(
    output_dir: str = "runs/demo", *, overrides: list[str] | None = None, **fields: Any
) -> dict[str, float]:
    """Train the demo CNN and return the test metrics (also printed)."""
    import time

    from functrain.trainer.core import Trainer

    start = time.perf_counter()
    cfg = config(output_dir, **fields)
    if overrides:
        cfg = cfg.with_overrides(overrides)
    train, val, test = digits_splits(cfg.seed)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(DigitsCNN(), cfg, train_dataset=train, eval_dataset=val)
    trainer.train()
    results = trainer.evaluate(test)
    elapsed = time.perf_counter() - start
    print(
        f"test accuracy {results['eval/accuracy']:.4f}  test loss {results['eval/loss']:.4f}  "
        f"({int(trainer.state.step)} steps, {elapsed:.1f} s; logs and checkpoints in {cfg.output_dir})"
    )
    return {**results, "seconds": elapsed}
