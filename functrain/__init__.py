"""functrain: functional, JAX-style training for PyTorch.

An immutable train state advanced by a pure step that ``torch.compile`` turns into one graph
(forward, backward and optimizer update together).

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    >>> tx = ft.optim.adamw(ft.optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.01)
    >>> state = ft.TrainState.create(model, tx, seed=0)
    >>> train_step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
    >>> state, metrics = train_step(state, (torch.randn(16, 8), torch.randint(0, 3, (16,))))
"""

from functrain import callbacks, checkpoint, data, logging, metrics, optim, precision, random, tree
from functrain.config import ConfigError, TrainerConfig
from functrain.jit import CompiledStep, DonatedStateError, GraphBreakError, RecompileError, jit
from functrain.loop import FitResult, evaluate, fit, predict
from functrain.remat import remat
from functrain.state import TrainState
from functrain.step import (
    make_eval_step,
    make_predict_step,
    make_train_step,
    supervised_loss,
)
from functrain.tasks import ImageClassificationTrainer, SegmentationTrainer
from functrain.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "CompiledStep",
    "ConfigError",
    "DonatedStateError",
    "FitResult",
    "GraphBreakError",
    "ImageClassificationTrainer",
    "RecompileError",
    "SegmentationTrainer",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "callbacks",
    "checkpoint",
    "data",
    "evaluate",
    "fit",
    "jit",
    "logging",
    "make_eval_step",
    "make_predict_step",
    "make_train_step",
    "metrics",
    "optim",
    "precision",
    "predict",
    "random",
    "remat",
    "supervised_loss",
    "tree",
]
