"""The named learning-rate schedules: ``scheduler.name`` -> how ``functrain.optim`` builds it.

This table is the one list of schedule names: the config accepts its keys (``SCHEDULER_NAMES``) and the
Trainer builds from its values (``functrain.trainer.build.schedule``, which adds the warm-up). Each builder
gets the ``functrain.optim`` module (passed in, so that reading a config loads no torch), the peak learning
rate, ``scheduler.args`` (it pops what it uses; what is left is an error), the steps after the warm-up and
the run's total. Adding a schedule is one entry here.

Example:
    >>> import functrain.optim as optim
    >>> float(SCHEDULES["linear"](optim, 1.0, {"end_value": 0.5}, 10, 10)(5))
    0.75
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SCHEDULES"]

Builder = Callable[[Any, float, dict[str, Any], int, int], Any]


def _all(args: dict[str, Any]) -> dict[str, Any]:
    """Every argument, passed on as keywords (the schedule itself refuses unknown ones)."""
    taken = dict(args)
    args.clear()
    return taken


def _step(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    step_size, gamma = args.pop("step_size"), args.pop("gamma", 0.1)
    boundaries = {k * step_size: gamma for k in range(1, max(rest // step_size, 0) + 1)}
    return optim.piecewise_constant_schedule(lr, boundaries)


def _exponential(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    steps, rate = args.pop("transition_steps", 1), args.pop("decay_rate", 0.96)
    return optim.exponential_decay(lr, steps, rate, **_all(args))


def _cosine(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    return optim.cosine_decay_schedule(lr, rest, **_all(args))


def _polynomial(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    """``lr_end`` is Hugging Face's name of ``end_value`` (its default there: 1e-7; here 0)."""
    if "end_value" in args and "lr_end" in args:
        raise TypeError("give one of end_value and lr_end (the same thing), not both")
    end = args.pop("end_value") if "end_value" in args else args.pop("lr_end", 0.0)
    return optim.polynomial_schedule(lr, end, args.pop("power", 1.0), rest)


def _cosine_with_min_lr(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    """Hugging Face's: the cosine down to ``min_lr`` (or ``min_lr_rate * lr``), one of them required."""
    if "min_lr" in args and "min_lr_rate" in args:
        raise TypeError("give one of min_lr and min_lr_rate, not both")
    rate = args.pop("min_lr") / lr if "min_lr" in args else args.pop("min_lr_rate")
    return optim.cosine_decay_schedule(lr, rest, alpha=rate)


def _cosine_with_restarts(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    """Hugging Face's hard restarts: ``num_cycles`` (default 1, may be fractional) cosines from ``lr`` to 0
    over the steps after the warm-up, then 0."""
    import math

    import torch

    cycles = float(args.pop("num_cycles", 1))

    def schedule(count: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        progress = torch.as_tensor(count).to(dtype) / rest
        value = lr * 0.5 * (1.0 + torch.cos(math.pi * torch.remainder(cycles * progress, 1.0)))
        return torch.where(progress >= 1.0, torch.zeros_like(value), value)

    return optim.schedules.takes_dtype(schedule)


def _inverse_sqrt(optim: Any, lr: float, args: dict[str, Any], rest: int, total: int) -> Any:
    """Hugging Face's (big_vision's): ``lr * sqrt(timescale / (count + timescale))`` after the warm-up;
    ``timescale`` defaults to the warm-up's length, or 10,000 without one."""
    import torch

    timescale = float(args.pop("timescale", None) or (total - rest if total > rest else 10_000))

    def schedule(count: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return lr * torch.rsqrt((torch.as_tensor(count).to(dtype) + timescale) / timescale)

    return optim.schedules.takes_dtype(schedule)


SCHEDULES: dict[str, Builder] = {
    "constant": lambda optim, lr, args, rest, total: optim.constant_schedule(lr),
    "linear": lambda optim, lr, args, rest, total: optim.linear_schedule(
        lr, args.pop("end_value", 0.0), rest
    ),
    "cosine": _cosine,
    "warmup_cosine": _cosine,
    "cosine_with_min_lr": _cosine_with_min_lr,
    "cosine_with_restarts": _cosine_with_restarts,
    "inverse_sqrt": _inverse_sqrt,
    "exponential": _exponential,
    "step": _step,
    "piecewise": lambda optim, lr, args, rest, total: optim.piecewise_constant_schedule(
        lr, {int(k): float(v) for k, v in args.pop("boundaries_and_scales").items()}
    ),
    "polynomial": _polynomial,
    # its own warm-up phase (pct_start): the config refuses warmup_steps/warmup_ratio with it
    "one_cycle": lambda optim, lr, args, rest, total: optim.one_cycle_schedule(total, lr, **_all(args)),
}
