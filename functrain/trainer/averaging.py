"""The weight average of ``config.ema`` in the Trainer, in one place: chained last in the optimizer,
evaluated with (``ema.evaluate``), and restored with the best checkpoint.

Example:
    >>> import functrain as ft
    >>> cfg = ft.TrainerConfig(max_steps=1, ema=0.999)
    >>> [type(c).__name__ for c in callbacks(cfg)]
    ['AveragedEvaluation']
"""

from __future__ import annotations

from typing import Any

from functrain import optim
from functrain.callbacks import AveragedEvaluation, Callback
from functrain.config import TrainerConfig
from functrain.optim.averaging import ema, with_averaged_params

__all__ = ["callbacks", "chain", "eval_state", "restored_fields"]


def chain(config: TrainerConfig, tx: optim.GradientTransformation) -> optim.GradientTransformation:
    """``tx`` with the EMA chained last (it averages the params the update produces); ``tx`` without one."""
    if config.ema is None:
        return tx
    return optim.chain(tx, ema(config.ema.decay, warmup=config.ema.warmup))


def eval_state(config: TrainerConfig, state: Any) -> Any:
    """The state evaluations and predictions use: with ``ema.evaluate``, the averaged weights."""
    return with_averaged_params(state) if _evaluates(config) else state


def callbacks(config: TrainerConfig) -> list[Callback]:
    """During ``fit``: evaluate with the average when ``ema.evaluate``."""
    return [AveragedEvaluation()] if _evaluates(config) else []


def restored_fields(config: TrainerConfig) -> tuple[str, ...]:
    """What loading the best checkpoint at the end restores: the weights, and the average with them."""
    return ("params", "buffers", "opt_state") if config.ema is not None else ("params", "buffers")


def _evaluates(config: TrainerConfig) -> bool:
    return config.ema is not None and config.ema.evaluate
