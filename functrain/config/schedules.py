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


SCHEDULES: dict[str, Builder] = {
    "constant": lambda optim, lr, args, rest, total: optim.constant_schedule(lr),
    "linear": lambda optim, lr, args, rest, total: optim.linear_schedule(
        lr, args.pop("end_value", 0.0), rest
    ),
    "cosine": _cosine,
    "warmup_cosine": _cosine,
    "exponential": _exponential,
    "step": _step,
    "piecewise": lambda optim, lr, args, rest, total: optim.piecewise_constant_schedule(
        lr, {int(k): float(v) for k, v in args.pop("boundaries_and_scales").items()}
    ),
    "polynomial": lambda optim, lr, args, rest, total: optim.polynomial_schedule(
        lr, args.pop("end_value", 0.0), args.pop("power", 1.0), rest
    ),
    # its own warm-up phase (pct_start): the config refuses warmup_steps/warmup_ratio with it
    "one_cycle": lambda optim, lr, args, rest, total: optim.one_cycle_schedule(total, lr, **_all(args)),
}
