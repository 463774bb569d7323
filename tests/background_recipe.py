"""Recipes for tests/test_background_build.py: what the child process of
:class:`functrain.compile.background.BackgroundBuild` imports (from the test process's ``sys.path``)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from models import classification_batch, mlp

import functrain as ft
from functrain.compile.background import Warmup
from functrain.compile.tiers import tiered

LOSS = ft.supervised_loss(F.cross_entropy)
BATCH = 8


def dataset(n: int = 40, seed: int = 0) -> list:
    return list(zip(*classification_batch(n, seed=seed)))


def model_and_state() -> tuple[torch.nn.Module, ft.TrainState]:
    torch.manual_seed(0)
    model = mlp(dropout=0.5)
    return model, ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)


def warmups() -> list[Warmup]:
    """The test run's train step, on a batch of zeros of its shapes and dtypes (fit's collated batch)."""
    model, state = model_and_state()
    x, y = torch.utils.data.default_collate(dataset(BATCH))
    return [
        Warmup(tiered(ft.make_train_step(model, LOSS)), state, ((torch.zeros_like(x), torch.zeros_like(y)),))
    ]


def broken() -> list[Warmup]:
    raise RuntimeError("the recipe broke")


def forever() -> list[Warmup]:
    time.sleep(600)
    return []
