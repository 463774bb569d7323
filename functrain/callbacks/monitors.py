"""Monitors: learning rate, timing and throughput (LiBai's IterationTimer), non-finite losses."""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from typing import Any, Literal

import torch

from functrain.callbacks.base import Callback, Context
from functrain.data import num_examples

__all__ = ["LearningRateMonitor", "NonFiniteGuard", "NonFiniteLossError", "Timer"]


class LearningRateMonitor(Callback):
    """Log the optimizer's hyperparameters (``lr`` and the rest) from ``state.opt_state`` on logging steps.

    Values are read from the state as tensors and converted only when the loop logs (no extra sync).

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> result = ft.fit(state, step, data, batch_size=16, epochs=1, progress_bar=False,
        ...                 callbacks=[LearningRateMonitor()])
        >>> round(result.history.latest("lr"), 6)
        0.1
    """

    def __init__(self, names: tuple[str, ...] | None = ("learning_rate",)) -> None:
        self.names = names  # None: every hyperparameter

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        if ctx.logging_step:
            from functrain.core.member_names import expand_members
            from functrain.optim import hyperparams

            for name, value in hyperparams(state.opt_state).items():
                if self.names is None or name in self.names:
                    key = "lr" if name == "learning_rate" else name
                    members = value.shape[0] if value.ndim == 1 else None  # an ensemble: one per member
                    ctx.history.put_scalars(expand_members({key: value}, members), ctx.step)
        return state


class Timer(Callback):
    """Steps/s, samples/s, ETA and peak memory over each logging window (LiBai's IterationTimer).

    Times are host wall-clock between logging steps; on an accelerator the loop's logging sync makes
    them honest without adding any sync of the timer's own. ``time/eta_s`` uses the rate of the latest
    window in which no step compiled (``ctx.compiles`` unchanged): a compile takes seconds to minutes
    once, and counting it in the rate would predict hours. Until such a window, no ETA is logged.

    Example:
        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> result = ft.fit(state, step, data, batch_size=16, epochs=1, log_steps=1, progress_bar=False,
        ...                 callbacks=[Timer()])
        >>> sorted(name for name in result.history.names() if name.startswith("time/"))
        ['time/eta_s', 'time/samples_per_s', 'time/steps_per_s']
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._steps = 0
        self._samples = 0
        self.total_time = 0.0
        self._compiles = 0
        self._warm_rate: float | None = None

    def on_train_begin(self, state: Any, ctx: Context) -> Any:
        self._t0 = time.perf_counter()
        self._start = self._t0
        self._compiles, self._warm_rate = ctx.compiles, None
        return state

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        self._steps += 1
        with contextlib.suppress(TypeError, ValueError):  # a batch without tensors: count steps only
            self._samples += num_examples(ctx.batch)
        if ctx.logging_step:
            now = time.perf_counter()
            dt = max(now - self._t0, 1e-9)
            rate = self._steps / dt
            ctx.history.put("time/steps_per_s", rate, ctx.step)
            ctx.history.put("time/samples_per_s", self._samples / dt, ctx.step)
            if ctx.compiles == self._compiles:  # a steady-state window: no compilation in it
                self._warm_rate = rate
            if ctx.max_steps and self._warm_rate is not None:
                ctx.history.put("time/eta_s", (ctx.max_steps - ctx.step) / self._warm_rate, ctx.step)
            ctx.history.put("memory/peak_mb", peak_memory_mb(state), ctx.step)
            self._t0, self._steps, self._samples, self._compiles = now, 0, 0, ctx.compiles
        return state

    def on_train_end(self, state: Any, ctx: Context) -> Any:
        self.total_time = time.perf_counter() - self._start
        return state


def peak_memory_mb(state: Any = None) -> float:
    """Peak accelerator memory when the state lives on CUDA, else the process's peak RSS, in MiB."""
    device = getattr(state, "device", torch.device("cpu"))
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class NonFiniteLossError(FloatingPointError):
    """Raised by :class:`NonFiniteGuard` with ``action="raise"``."""


class NonFiniteGuard(Callback):
    """Watch the training loss and act when it is NaN or infinite, naming the step.

    Actions: ``"stop"`` ends the run (the state before the bad step is kept when available),
    ``"skip"`` discards the bad step's update and goes on, ``"raise"`` raises
    :class:`NonFiniteLossError`. ``check_every=1`` checks every step (one host sync per step);
    larger values check only then, and ``"skip"`` requires 1.

    Example:
        >>> guard = NonFiniteGuard(action="skip")
    """

    def __init__(self, action: Literal["stop", "skip", "raise"] = "stop", check_every: int = 1) -> None:
        if action not in ("stop", "skip", "raise"):
            raise ValueError(f"NonFiniteGuard: action must be 'stop', 'skip' or 'raise', got {action!r}")
        if action == "skip" and check_every != 1:
            raise ValueError("NonFiniteGuard: action='skip' needs check_every=1 (every step is checked)")
        self.action = action
        self.check_every = check_every
        self.bad_steps: list[int] = []

    def state_dict(self) -> Any:
        return {"bad_steps": list(self.bad_steps)}

    def load_state_dict(self, state: Any) -> None:
        self.bad_steps = [int(s) for s in state["bad_steps"]]

    def on_step_end(self, state: Any, ctx: Context) -> Any:
        if ctx.step % self.check_every or "loss" not in ctx.metrics:
            return state
        loss = float(ctx.metrics["loss"])
        if math.isfinite(loss):
            return state
        self.bad_steps.append(ctx.step)
        message = f"non-finite training loss ({loss}) at step {ctx.step} (epoch {ctx.epoch}, batch {ctx.batch_index})"
        if self.action == "raise":
            raise NonFiniteLossError(message + "; lower the learning rate, clip gradients or check the data")
        if self.action == "skip":
            if ctx.previous_state is None:
                raise NonFiniteLossError(
                    message + "; action='skip' cannot undo a donating step (donate=False)"
                )
            return ctx.previous_state.replace(step=state.step)
        ctx.control.stop(message)
        return ctx.previous_state if ctx.previous_state is not None else state
