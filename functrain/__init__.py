"""functrain: functional, JAX-style training for PyTorch.

An immutable train state advanced by a pure step that ``torch.compile`` turns into one graph
(forward, backward and optimizer update together).

The names below are imported on first use (PEP 562), so ``import functrain`` and ``functrain --help``
stay fast; ``functrain.jit`` and the rest load torch when they are touched.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    >>> tx = ft.optim.adamw(ft.optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.01)
    >>> state = ft.TrainState.create(model, tx, seed=0)
    >>> train_step = ft.jit(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
    >>> state, metrics = train_step(state, (torch.randn(16, 8), torch.randint(0, 3, (16,))))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from functrain.core import lazy as _lazy

_SUBMODULES = (
    "callbacks",
    "checkpoint",
    "data",
    "ensemble",
    "logging",
    "metrics",
    "optim",
    "precision",
    "random",
    "tree",
)
# public name -> the module defining it
_LAZY: dict[str, str] = {
    "ConfigError": "functrain.config",
    "TrainerConfig": "functrain.config",
    **dict.fromkeys(
        ("CompiledStep", "DonatedStateError", "GraphBreakError", "RecompileError", "jit"), "functrain.jit"
    ),
    **dict.fromkeys(("FitResult", "RunFinishedWarning", "evaluate", "fit", "predict"), "functrain.loop"),
    **dict.fromkeys(("ModelSummary", "summary"), "functrain.model_summary"),
    "remat": "functrain.remat",
    "TrainState": "functrain.state",
    **dict.fromkeys(
        ("make_eval_step", "make_predict_step", "make_train_step", "supervised_loss"), "functrain.step"
    ),
    **dict.fromkeys(("ImageClassificationTrainer", "SegmentationTrainer"), "functrain.trainer.tasks"),
    "Trainer": "functrain.trainer",
    "__version__": "functrain._version",  # from the package metadata (importlib.metadata), on first use
}

__all__ = [
    "CompiledStep",
    "ConfigError",
    "DonatedStateError",
    "FitResult",
    "GraphBreakError",
    "ImageClassificationTrainer",
    "ModelSummary",
    "RecompileError",
    "RunFinishedWarning",
    "SegmentationTrainer",
    "TrainState",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "callbacks",
    "checkpoint",
    "data",
    "ensemble",
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
    "summary",
    "supervised_loss",
    "tree",
]


_lazy.install(__name__, _LAZY, _SUBMODULES)

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from functrain import (
        callbacks,
        checkpoint,
        data,
        ensemble,
        logging,
        metrics,
        optim,
        precision,
        random,
        tree,
    )
    from functrain._version import __version__
    from functrain.config import ConfigError, TrainerConfig
    from functrain.jit import CompiledStep, DonatedStateError, GraphBreakError, RecompileError, jit
    from functrain.loop import FitResult, RunFinishedWarning, evaluate, fit, predict
    from functrain.model_summary import ModelSummary, summary
    from functrain.remat import remat
    from functrain.state import TrainState
    from functrain.step import make_eval_step, make_predict_step, make_train_step, supervised_loss
    from functrain.trainer import Trainer
    from functrain.trainer.tasks import ImageClassificationTrainer, SegmentationTrainer
