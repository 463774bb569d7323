"""Callbacks are state transformers: ``on_event(state, ctx) -> state``.

A callback receives the train state and a :class:`Context` describing what just happened, and returns a
state — the same one, or a new one (a changed learning rate, restored best weights). It never reaches
into hidden loop internals; to steer the run it sets flags on ``ctx.control`` (stop, evaluate, save,
log), and the loop honours every request at the next step boundary.

A callback is a per-run object (never patched onto a class). What it must remember across a resume
(early-stopping counters, the best value) it returns from :meth:`Callback.state_dict` as a pytree of
tensors and Python scalars; the loop saves it in every checkpoint and hands it back through
:meth:`Callback.load_state_dict` on resume.

Events, in the order the loop fires them (``EVENTS``)::

    train_begin
      [checkpoint_restored]                      on resume, right after train_begin
      epoch_begin
        step_begin  step_end                     once per optimizer step
        [eval_begin (eval_batch_begin eval_batch_end)* eval_end]   when an evaluation is due
        [checkpoint_saved]                       when a checkpoint was written
      epoch_end                                  then epoch-level evaluation and saving
    train_end

This covers Towhee's twelve events and LiBai's before/after train/step hooks.

Example:
    >>> import functrain as ft
    >>> class HalveLR(ft.callbacks.Callback):
    ...     def on_epoch_end(self, state, ctx):
    ...         lr = ft.optim.hyperparams(state.opt_state)["learning_rate"]
    ...         return state.replace(opt_state=ft.optim.set_hyperparams(state.opt_state, learning_rate=lr / 2))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["EVENTS", "Callback", "Context", "Control", "LambdaCallback"]

EVENTS = (
    "train_begin",
    "checkpoint_restored",
    "epoch_begin",
    "step_begin",
    "step_end",
    "eval_begin",
    "eval_batch_begin",
    "eval_batch_end",
    "eval_end",
    "checkpoint_saved",
    "epoch_end",
    "train_end",
)


@dataclasses.dataclass
class Control:
    """Requests from callbacks to the loop; each one is honoured at the next step boundary, then reset.

    Example:
        >>> control = Control()
        >>> control.stop("patience exhausted")
        >>> control.should_stop, control.stop_reason
        (True, 'patience exhausted')
    """

    should_stop: bool = False
    stop_reason: str = ""
    stop_is_final: bool = True
    should_evaluate: bool = False
    should_save: bool = False
    should_log: bool = False

    def stop(self, reason: str = "", *, final: bool = True) -> None:
        """Ask the loop to end the run after the current step (final evaluation/saving still happen).

        A ``final`` stop (early stopping, a callback deciding the run is done) is recorded in the
        checkpoint: resuming the run returns its final state instead of training on. ``final=False``
        (preemption) leaves the run resumable, unless another callback asked for a final stop in the same
        step (whatever the callbacks' order).
        """
        self.stop_is_final = final or (self.should_stop and self.stop_is_final)
        self.should_stop = True
        self.stop_reason = reason or self.stop_reason

    def evaluate(self) -> None:
        """Ask for an evaluation after the current step."""
        self.should_evaluate = True

    def save(self) -> None:
        """Ask for a checkpoint after the current step."""
        self.should_save = True

    def log(self) -> None:
        """Ask for the metrics to be logged after the current step."""
        self.should_log = True


@dataclasses.dataclass
class Context:
    """What just happened, for a callback. Read it; steer the run through ``control``.

    Attributes:
        step: optimizer steps done (a Python int the loop keeps: reading it never syncs).
        epoch: the current epoch (0-based); ``batch_index``: batches done in it.
        batches_per_epoch, max_steps: the run's length (``None`` when unknown); ``log_steps``: how often
            the loop logs; ``logging_step``: whether the loop logs
            after this step's ``step_end`` (callbacks that put values in ``history`` do it then, and they
            are written with the rest).
        metrics: the last train step's metrics, as tensors (call ``float()`` only when you need a value:
            that waits for the device).
        logs: the latest logged values (floats) by name, e.g. ``"train/loss"``, ``"eval/accuracy"``.
        eval_metrics: the last evaluation's results (floats), set from ``eval_end`` on.
        history: the run's :class:`functrain.logging.History`.
        control: requests to the loop.
        batch: the current batch (train or eval), ``previous_state``: the state before the current step
            (``None`` when the step donates its input).
        checkpoint_path: set for ``checkpoint_saved`` / ``checkpoint_restored``.
        compiles: graphs the run's train and eval steps have compiled so far (``CompiledStep.num_compiles``);
            a change tells a timer that the last steps included a compilation.
        tier: what runs the train step (``"eager"``, ``"inductor"``; ``""``: a plain function), set before
            ``step_begin``; ``compiling``: whether this step waits for a compile (:mod:`functrain.compile.tiers`).
    """

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    batches_per_epoch: int | None = None
    max_steps: int | None = None
    log_steps: int = 50
    logging_step: bool = False
    metrics: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    logs: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_metrics: dict[str, float] | None = None
    history: Any = None
    control: Control = dataclasses.field(default_factory=Control)
    batch: Any = None
    previous_state: Any = None
    checkpoint_path: str | None = None
    phase: str = "train"
    compiles: int = 0
    tier: str = ""
    compiling: bool = False


class Callback:
    """Base class: every event returns the state unchanged; override the ones you need.

    Each ``on_<event>(state, ctx)`` must return a state. ``state_dict()``/``load_state_dict()`` carry the
    callback's own state through checkpoints (default: nothing to carry).

    Example:
        >>> class CountSteps(Callback):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def on_step_end(self, state, ctx):
        ...         self.steps += 1
        ...         return state
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, d):
        ...         self.steps = int(d["steps"])
    """

    #: the key under which the loop saves this callback's state (default: the class name)
    name: str | None = None

    def state_dict(self) -> Any:
        """A pytree (tensors, Python scalars, strings, containers) to save with the checkpoint."""
        return {}

    def load_state_dict(self, state: Any) -> None:
        """Restore what :meth:`state_dict` returned (on resume)."""

    def on_train_begin(self, state: Any, ctx: Context) -> Any:
        return state

    def on_checkpoint_restored(self, state: Any, ctx: Context) -> Any:
        return state

    def on_epoch_begin(self, state: Any, ctx: Context) -> Any:
        return state

    def on_step_begin(self, state: Any, ctx: Context) -> Any:
        return state

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        return state

    def on_eval_begin(self, state: Any, ctx: Context) -> Any:
        return state

    def on_eval_batch_begin(self, state: Any, ctx: Context) -> Any:
        return state

    def on_eval_batch_end(self, state: Any, ctx: Context) -> Any:
        return state

    def on_eval_end(self, state: Any, ctx: Context) -> Any:
        return state

    def on_checkpoint_saved(self, state: Any, ctx: Context) -> Any:
        return state

    def on_epoch_end(self, state: Any, ctx: Context) -> Any:
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        return state


class LambdaCallback(Callback):
    """A callback from functions: ``LambdaCallback(on_step_end=lambda state, ctx: state)``.

    Example:
        >>> stop_at_10 = LambdaCallback(on_step_end=lambda s, ctx: (ctx.step >= 10 and ctx.control.stop()) or s)
    """

    def __init__(self, name: str | None = None, **handlers: Callable[[Any, Context], Any]) -> None:
        unknown = sorted(set(handlers) - {f"on_{e}" for e in EVENTS})
        if unknown:
            raise TypeError(f"LambdaCallback: unknown events {unknown}; known: {[f'on_{e}' for e in EVENTS]}")
        self.name = name
        for event, fn in handlers.items():
            setattr(self, event, fn)
