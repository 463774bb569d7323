"""Callbacks: state transformers fired by the loop between steps (see :mod:`functrain.callbacks.base`).

Example:
    >>> import functrain as ft
    >>> callbacks = [ft.callbacks.EarlyStopping("eval/loss", patience=3), ft.callbacks.LearningRateMonitor()]
"""

from functrain.callbacks.base import EVENTS, Callback, Context, Control, LambdaCallback
from functrain.callbacks.checkpointing import ModelCheckpoint
from functrain.callbacks.early_stopping import EarlyStopping
from functrain.callbacks.monitors import LearningRateMonitor, NonFiniteGuard, NonFiniteLossError, Timer
from functrain.callbacks.nonfinite import SkippedSteps, skip_nonfinite
from functrain.callbacks.preemption import Preemption
from functrain.callbacks.profiler import Profiler
from functrain.callbacks.progress import PrintMetrics, ProgressBar

__all__ = [
    "EVENTS",
    "Callback",
    "Context",
    "Control",
    "EarlyStopping",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "Preemption",
    "PrintMetrics",
    "Profiler",
    "ProgressBar",
    "SkippedSteps",
    "Timer",
    "skip_nonfinite",
]
