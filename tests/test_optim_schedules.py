"""Schedules against torch.optim.lr_scheduler (closed forms) at many steps, and their tensor behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from functrain import optim

LR = 0.1


def _torch_lrs(make_scheduler, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    """The lr torch uses for each of ``steps`` optimizer steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def _ours(schedule, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    return schedule(torch.arange(steps)).tolist()


CASES = {
    "linear": (
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=40),
        optim.linear_schedule(0.25 * LR, LR, 40),
    ),
    "cosine": (
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=150, eta_min=0.01),
        optim.cosine_decay_schedule(LR, 150, alpha=0.01 / LR),
    ),
    "exponential": (
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.98),
        optim.exponential_decay(LR, transition_steps=1, decay_rate=0.98),
    ),
    "step": (
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=30, gamma=0.5),
        optim.exponential_decay(LR, transition_steps=30, decay_rate=0.5, staircase=True),
    ),
    "multistep": (
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[20, 70, 120], gamma=0.3),
        optim.piecewise_constant_schedule(LR, {20: 0.3, 70: 0.3, 120: 0.3}),
    ),
    "polynomial": (
        lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=100, power=2.0),
        optim.polynomial_schedule(LR, 0.0, 2.0, 100),
    ),
    "one_cycle": (
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=LR, total_steps=150),
        optim.one_cycle_schedule(150, LR),
    ),
    "one_cycle_linear_three_phase": (
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=LR, total_steps=150, anneal_strategy="linear", three_phase=True, pct_start=0.25
        ),
        optim.one_cycle_schedule(150, LR, pct_start=0.25, anneal_strategy="linear", three_phase=True),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_schedule_matches_torch_lr_scheduler(name: str) -> None:
    make_scheduler, schedule = CASES[name]
    steps = 150
    expected = _torch_lrs(make_scheduler, steps)
    torch.testing.assert_close(
        torch.tensor(_ours(schedule, steps)), torch.tensor(expected), rtol=1e-5, atol=1e-8
    )


def test_warmup_cosine_closed_form() -> None:
    init, peak, warmup, total, end = 0.01, 1.0, 10, 110, 0.05
    schedule = optim.warmup_cosine_decay_schedule(init, peak, warmup, total, end)
    for step in range(0, 130, 3):
        if step < warmup:
            expected = init + (peak - init) * step / warmup
        else:
            t = min(step - warmup, total - warmup) / (total - warmup)
            expected = end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))
        assert math.isclose(float(schedule(step)), expected, rel_tol=1e-5, abs_tol=1e-7), step


def test_join_schedules_shifts_the_count() -> None:
    schedule = optim.join_schedules(
        [optim.constant_schedule(1.0), optim.linear_schedule(2.0, 0.0, 10), optim.constant_schedule(5.0)],
        [3, 8],
    )
    assert _ours(schedule, 10) == pytest.approx([1, 1, 1, 2.0, 1.8, 1.6, 1.4, 1.2, 5, 5])


def test_exponential_decay_end_value_and_begin() -> None:
    schedule = optim.exponential_decay(
        1.0, transition_steps=1, decay_rate=0.5, transition_begin=2, end_value=0.2
    )
    assert _ours(schedule, 6) == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.25, 0.2])


def test_schedules_accept_ints_and_tensors_and_keep_device_and_shape() -> None:
    schedule = optim.warmup_cosine_decay_schedule(0.0, 1.0, 5, 20)
    from_int = schedule(7)
    from_tensor = schedule(torch.tensor(7))
    assert from_int.shape == () and from_int.dtype == torch.float32
    assert torch.equal(from_int, from_tensor)


def test_schedule_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="decay_steps"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=10)
    with pytest.raises(TypeError, match="transition_steps"):
        optim.linear_schedule(0.0, 1.0, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="boundaries"):
        optim.join_schedules([optim.constant_schedule(1.0)], [3])
    with pytest.raises(ValueError, match="phase"):
        optim.one_cycle_schedule(2, 1.0)
