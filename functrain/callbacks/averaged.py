"""Evaluate with the weight average (:mod:`functrain.optim.averaging`) while training goes on with the live
params.

Example:
    >>> import functrain as ft
    >>> callbacks = [ft.callbacks.AveragedEvaluation()]
"""

from __future__ import annotations

from typing import Any

from functrain.callbacks.base import Callback, Context
from functrain.optim.averaging import with_averaged_params
from functrain.tree import PyTree

__all__ = ["AveragedEvaluation"]


class AveragedEvaluation(Callback):
    """Evaluate with the averaged params during ``fit``: swaps them in at ``eval_begin`` and the live params
    back at ``eval_end`` (training goes on with the live params; eval metrics are the average's).

    Example:
        >>> import functrain as ft
        >>> callbacks = [ft.callbacks.AveragedEvaluation()]
    """

    name = "AveragedEvaluation"

    def __init__(self) -> None:
        self._live: PyTree = None

    def on_eval_begin(self, state: Any, ctx: Context) -> Any:
        self._live = state.params
        return with_averaged_params(state)

    def on_eval_end(self, state: Any, ctx: Context) -> Any:
        live, self._live = self._live, None
        return state if live is None else state.replace(params=live)
