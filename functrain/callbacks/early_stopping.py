"""Early stopping on a monitored metric, with optional restoring of the best weights."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from functrain import tree
from functrain.callbacks.base import Callback, Context

__all__ = ["EarlyStopping", "is_improvement"]


def is_improvement(value: float, best: float, mode: str, min_delta: float) -> bool:
    """True when ``value`` beats ``best`` by more than ``min_delta`` in direction ``mode``.

    Example:
        >>> is_improvement(0.5, 0.6, "min", 0.05), is_improvement(0.58, 0.6, "min", 0.05)
        (True, False)
    """
    if math.isnan(value):
        return False
    return value < best - min_delta if mode == "min" else value > best + min_delta


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` evaluations.

    Its counters (best value, evaluations without improvement, best step) and, with
    ``restore_best=True``, the best params and buffers are saved in checkpoints, so a resumed run stops
    at the same evaluation. At the end of training (stopped early or not) ``restore_best`` puts the best
    weights back into the returned state.

    Example:
        >>> stopper = EarlyStopping(monitor="eval/loss", mode="min", patience=3, restore_best=True)
    """

    def __init__(
        self,
        monitor: str = "eval/loss",
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        restore_best: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"EarlyStopping: patience must be >= 1, got {patience}")
        if min_delta < 0:
            raise ValueError(f"EarlyStopping: min_delta must be >= 0, got {min_delta}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.restore_best = restore_best
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step = -1
        self.wait = 0
        self.stopped_step = -1
        self.best_weights: dict[str, Any] | None = None

    def state_dict(self) -> Any:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
            "stopped_step": self.stopped_step,
            "best_weights": self.best_weights if self.restore_best else None,
        }

    def load_state_dict(self, state: Any) -> None:
        self.best = float(state["best"])
        self.best_step = int(state["best_step"])
        self.wait = int(state["wait"])
        self.stopped_step = int(state["stopped_step"])
        if self.restore_best:
            self.best_weights = state.get("best_weights")

    def on_eval_end(self, state: Any, ctx: Context) -> Any:
        results = ctx.eval_metrics or {}
        if self.monitor not in results:
            raise KeyError(
                f"EarlyStopping: monitored metric {self.monitor!r} is not among the evaluation results "
                f"{sorted(results)}; set monitor= to one of them"
            )
        value = float(results[self.monitor])
        if is_improvement(value, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.wait = value, ctx.step, 0
            if self.restore_best:
                self.best_weights = tree.map(
                    lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x,
                    {"params": state.params, "buffers": state.buffers},
                )
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_step = ctx.step
                ctx.control.stop(
                    f"early stopping: {self.monitor} did not improve for {self.patience} evaluations "
                    f"(best {self.best:.6g} at step {self.best_step})"
                )
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        if self.restore_best and self.best_weights is not None:
            return state.replace(params=self.best_weights["params"], buffers=self.best_weights["buffers"])
        return state
