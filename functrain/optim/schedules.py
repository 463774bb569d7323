"""Schedules: pure functions ``count -> value`` written with tensor ops only.

A schedule takes the step count (a 0-d int tensor, or a Python int for convenience) and returns a
float32 tensor of the same shape and device. The built-in ones also take ``dtype=``: the optimizers call
them through :func:`evaluate` with ``torch.float64`` when the params are float64, so a float64 run's
learning rate is computed in double, as torch's LR schedulers compute it. There is no Python branching on the count, so a schedule
called inside a compiled step is part of the one graph and never recompiles as the count advances.
Schedules also work elementwise: ``schedule(torch.arange(1000))`` gives the whole curve for a plot.

Conventions follow optax: ``count`` is the number of updates done so far, so the first update uses
``schedule(0)`` (as ``torch.optim.lr_scheduler`` uses the initial lr for the first ``optimizer.step()``).

Example:
    >>> from functrain import optim
    >>> lr = optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
    >>> [round(float(lr(s)), 4) for s in (0, 5, 10, 60, 110, 500)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from functrain.optim._leaves import check_nonnegative, check_range, check_real
from functrain.optim.base import Schedule

__all__ = [
    "constant_schedule",
    "cosine_decay_schedule",
    "evaluate",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "one_cycle_schedule",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "takes_dtype",
    "warmup_cosine_decay_schedule",
]


def _count(count: int | torch.Tensor) -> torch.Tensor:
    """The count as a tensor (int64 for Python ints), accepting both forms."""
    if isinstance(count, torch.Tensor):
        return count
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"a schedule takes an int or an integer tensor count, got {type(count).__name__}")
    return torch.tensor(count, dtype=torch.int64)


def _float_count(count: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _count(count).to(dtype)


def takes_dtype(schedule: Callable[..., torch.Tensor]) -> Schedule:
    """Mark a schedule ``(count, dtype=torch.float32) -> value`` as computing in ``dtype`` (the built-in
    ones are; see :func:`evaluate`).

    Example:
        >>> @takes_dtype
        ... def halving(count, dtype=torch.float32):
        ...     return 0.5 ** torch.as_tensor(count).to(dtype)
        >>> evaluate(halving, 3, torch.float64).dtype
        torch.float64
    """
    schedule.takes_dtype = True  # type: ignore[attr-defined]
    return schedule


def evaluate(schedule: Schedule, count: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``schedule(count)`` as ``dtype``: a built-in schedule computes in ``dtype``; any other schedule is
    called with the count alone and its value cast.

    Example:
        >>> float(evaluate(constant_schedule(0.1), 3, torch.float64))
        0.1
        >>> mine = lambda count: torch.full_like(count, 0.1, dtype=torch.float32)  # computed in float32
        >>> float(evaluate(mine, 3, torch.float64))
        0.10000000149011612
    """
    if getattr(schedule, "takes_dtype", False):
        return schedule(count, dtype=dtype)  # type: ignore[call-arg]
    return schedule(_count(count)).to(dtype)


def _check_steps(who: str, name: str, value: int, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{who}: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def constant_schedule(value: float) -> Schedule:
    """Always ``value``.

    Example:
        >>> float(constant_schedule(0.1)(1000))
        0.10000000149011612
    """
    value = check_real("constant_schedule", "value", value)

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full_like(_float_count(count, dtype), value)

    return takes_dtype(schedule)


def polynomial_schedule(
    init_value: float, end_value: float, power: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """``end + (init - end) * (1 - t / transition_steps) ** power`` with ``t = clamp(count - begin, 0, steps)``.

    ``polynomial_schedule(lr, 0.0, power, total)`` is ``torch.optim.lr_scheduler.PolynomialLR(total_iters=total,
    power=power)``.

    Example:
        >>> float(polynomial_schedule(1.0, 0.0, power=2.0, transition_steps=10)(5))
        0.25
    """
    who = "polynomial_schedule"
    init_value, end_value = check_real(who, "init_value", init_value), check_real(who, "end_value", end_value)
    power = check_real(who, "power", power)
    transition_steps = _check_steps(who, "transition_steps", transition_steps)
    transition_begin = _check_steps(who, "transition_begin", transition_begin, allow_zero=True)

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.clamp(_float_count(count, dtype) - transition_begin, 0.0, float(transition_steps))
        return end_value + (init_value - end_value) * (1.0 - t / transition_steps) ** power

    return takes_dtype(schedule)


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps``, then constant.

    ``linear_schedule(lr * start_factor, lr * end_factor, total_iters)`` is
    ``torch.optim.lr_scheduler.LinearLR(start_factor, end_factor, total_iters)``.

    Example:
        >>> float(linear_schedule(0.0, 1.0, transition_steps=4)(1))
        0.25
    """
    return polynomial_schedule(init_value, end_value, 1.0, transition_steps, transition_begin)


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Half a cosine from ``init_value`` down to ``alpha * init_value`` over ``decay_steps``, then constant.

    ``value = init * ((1 - alpha) * (0.5 * (1 + cos(pi * min(count, T) / T))) ** exponent + alpha)``;
    with ``alpha = eta_min / lr`` it is ``CosineAnnealingLR(T_max=T, eta_min)`` for ``count <= T``
    (torch's continues as a periodic cosine after ``T``; this one stays at its end value).

    Example:
        >>> round(float(cosine_decay_schedule(1.0, decay_steps=10)(5)), 6)
        0.5
    """
    who = "cosine_decay_schedule"
    init_value = check_real(who, "init_value", init_value)
    decay_steps = _check_steps(who, "decay_steps", decay_steps)
    alpha = check_real(who, "alpha", alpha)
    exponent = check_real(who, "exponent", exponent)

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.clamp(_float_count(count, dtype), 0.0, float(decay_steps))
        cosine = 0.5 * (1.0 + torch.cos(t * (math.pi / decay_steps)))
        return init_value * ((1.0 - alpha) * cosine**exponent + alpha)

    return takes_dtype(schedule)


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then a cosine down to ``end_value``.

    As in optax, ``decay_steps`` is the *total* length including the warmup: the cosine runs from step
    ``warmup_steps`` to step ``decay_steps`` and the value stays at ``end_value`` after that.

    Example:
        >>> lr = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=12, end_value=0.1)
        >>> [round(float(lr(s)), 3) for s in (0, 1, 2, 7, 12)]
        [0.0, 0.5, 1.0, 0.55, 0.1]
    """
    who = "warmup_cosine_decay_schedule"
    init_value, peak_value = (
        check_real(who, "init_value", init_value),
        check_real(who, "peak_value", peak_value),
    )
    end_value, exponent = check_real(who, "end_value", end_value), check_real(who, "exponent", exponent)
    warmup_steps = _check_steps(who, "warmup_steps", warmup_steps, allow_zero=True)
    decay_steps = _check_steps(who, "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"{who}: decay_steps ({decay_steps}) is the total length including warmup and must be greater "
            f"than warmup_steps ({warmup_steps})"
        )
    cosine_steps = decay_steps - warmup_steps

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        c = _float_count(count, dtype)
        t = torch.clamp(c - warmup_steps, 0.0, float(cosine_steps))
        cosine = (0.5 * (1.0 + torch.cos(t * (math.pi / cosine_steps)))) ** exponent
        decayed = end_value + (peak_value - end_value) * cosine
        if warmup_steps == 0:
            return decayed
        warm = init_value + (peak_value - init_value) * torch.clamp(c / warmup_steps, 0.0, 1.0)
        return torch.where(c < warmup_steps, warm, decayed)

    return takes_dtype(schedule)


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init_value * decay_rate ** ((count - transition_begin) / transition_steps)``, floored if ``staircase``.

    ``exponential_decay(lr, 1, gamma)`` is ``ExponentialLR(gamma)``; ``exponential_decay(lr, step_size, gamma,
    staircase=True)`` is ``StepLR(step_size, gamma)``. ``end_value`` bounds the value (a floor when decaying,
    a ceiling when growing). Before ``transition_begin`` the value is ``init_value``.

    Example:
        >>> float(exponential_decay(1.0, transition_steps=10, decay_rate=0.5, staircase=True)(25))
        0.25
    """
    who = "exponential_decay"
    init_value = check_real(who, "init_value", init_value)
    transition_steps = _check_steps(who, "transition_steps", transition_steps)
    transition_begin = _check_steps(who, "transition_begin", transition_begin, allow_zero=True)
    decay_rate = check_real(who, "decay_rate", decay_rate)
    if decay_rate <= 0:
        raise ValueError(f"{who}: decay_rate must be > 0, got {decay_rate}")
    end = None if end_value is None else check_real(who, "end_value", end_value)
    log_rate = math.log(decay_rate)

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        p = torch.clamp(_float_count(count, dtype) - transition_begin, min=0.0) / transition_steps
        if staircase:
            p = torch.floor(p)
        value = init_value * torch.exp(p * log_rate)
        if end is not None:
            value = torch.clamp(value, min=end) if decay_rate < 1 else torch.clamp(value, max=end)
        return value

    return takes_dtype(schedule)


def piecewise_constant_schedule(init_value: float, boundaries_and_scales: Mapping[int, float]) -> Schedule:
    """``init_value`` multiplied by ``scale`` once ``count >= boundary``, for every boundary passed.

    ``piecewise_constant_schedule(lr, {m: gamma for m in milestones})`` is ``MultiStepLR(milestones, gamma)``.

    Example:
        >>> lr = piecewise_constant_schedule(1.0, {10: 0.1, 20: 0.5})
        >>> [round(float(lr(s)), 3) for s in (9, 10, 20)]
        [1.0, 0.1, 0.05]
    """
    who = "piecewise_constant_schedule"
    init_value = check_real(who, "init_value", init_value)
    items = []
    for boundary, factor in sorted(boundaries_and_scales.items()):
        _check_steps(who, f"boundary {boundary!r}", boundary, allow_zero=True)
        items.append((boundary, check_real(who, f"scale for boundary {boundary}", factor)))

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        c = _count(count)
        value = torch.full_like(c, init_value, dtype=dtype)
        for boundary, factor in items:
            value = torch.where(c >= boundary, value * factor, value)
        return value

    return takes_dtype(schedule)


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i + 1]`` from ``boundaries[i]`` on, called with the count *relative* to that boundary.

    Example:
        >>> warmup = linear_schedule(0.0, 1.0, transition_steps=5)
        >>> decay = exponential_decay(1.0, transition_steps=1, decay_rate=0.5)
        >>> lr = join_schedules([warmup, decay], boundaries=[5])
        >>> [float(lr(s)) for s in (0, 5, 6)]
        [0.0, 1.0, 0.5]
    """
    who = "join_schedules"
    schedules, boundaries = list(schedules), list(boundaries)
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"{who}: needs one more schedule than boundaries, got {len(schedules)} schedules and "
            f"{len(boundaries)} boundaries"
        )
    for b in boundaries:
        _check_steps(who, "a boundary", b, allow_zero=True)
    if boundaries != sorted(boundaries):
        raise ValueError(f"{who}: boundaries must be increasing, got {boundaries}")

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        c = _count(count)
        value = evaluate(schedules[0], c, dtype)
        for boundary, later in zip(boundaries, schedules[1:]):
            value = torch.where(c >= boundary, evaluate(later, c - boundary, dtype), value)
        return value

    return takes_dtype(schedule)


def one_cycle_schedule(
    total_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal_strategy: Literal["cos", "linear"] = "cos",
    three_phase: bool = False,
) -> Schedule:
    """The 1cycle learning rate of ``torch.optim.lr_scheduler.OneCycleLR`` (same arguments, same values).

    Up from ``peak_value / div_factor`` to ``peak_value`` over the first ``pct_start`` of ``total_steps``,
    then down to ``peak_value / div_factor / final_div_factor`` at step ``total_steps - 1`` (with
    ``three_phase``, back to the initial value first). After ``total_steps`` it stays at the final value.

    Example:
        >>> lr = one_cycle_schedule(100, peak_value=1.0)
        >>> round(float(lr(0)), 4), round(float(lr(29)), 4), float(lr(99)) < 1e-5
        (0.04, 1.0, True)
    """
    who = "one_cycle_schedule"
    total_steps = _check_steps(who, "total_steps", total_steps)
    peak_value = check_real(who, "peak_value", peak_value)
    pct_start = check_range(who, "pct_start", pct_start, 0.0, 1.0, high_open=False)
    div_factor = check_nonnegative(who, "div_factor", div_factor)
    final_div_factor = check_nonnegative(who, "final_div_factor", final_div_factor)
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"{who}: anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
    initial = peak_value / div_factor
    final = initial / final_div_factor
    if three_phase:
        phases = [
            (float(pct_start * total_steps) - 1, initial, peak_value),
            (float(2 * pct_start * total_steps) - 2, peak_value, initial),
            (total_steps - 1.0, initial, final),
        ]
    else:
        phases = [
            (float(pct_start * total_steps) - 1, initial, peak_value),
            (total_steps - 1.0, peak_value, final),
        ]
    starts = [0.0] + [end for end, _, _ in phases[:-1]]
    for start, (end, _, _) in zip(starts, phases):
        if end <= start:
            raise ValueError(
                f"{who}: a phase of {end - start} steps; raise total_steps ({total_steps}) or change "
                f"pct_start ({pct_start}) so every phase is at least one step long"
            )

    def anneal(start: float, end: float, pct: torch.Tensor) -> torch.Tensor:
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def schedule(count: int | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        c = _float_count(count, dtype)
        value = None
        for start, (end, low, high) in reversed(list(zip(starts, phases))):
            pct = torch.clamp((c - start) / (end - start), 0.0, 1.0)
            here = anneal(low, high, pct)
            value = here if value is None else torch.where(c <= end, here, value)
        assert value is not None
        return value

    return takes_dtype(schedule)
