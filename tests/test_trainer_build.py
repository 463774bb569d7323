"""The Trainer's builders (functrain.trainer.build): the schedule table is the config's list of names, and
each name builds the functrain.optim schedule it stands for."""

from __future__ import annotations

from pathlib import Path

import pytest

import functrain as ft
from functrain import optim
from functrain.config import SCHEDULER_NAMES
from functrain.config.schedules import SCHEDULES
from functrain.trainer import build

LR, TOTAL = 0.1, 100

# name -> (scheduler.args, the same schedule built from functrain.optim directly, no warm-up)
EXPECTED = {
    "constant": ({}, optim.constant_schedule(LR)),
    "linear": ({"end_value": 0.01}, optim.linear_schedule(LR, 0.01, TOTAL)),
    "cosine": ({"alpha": 0.1}, optim.cosine_decay_schedule(LR, TOTAL, alpha=0.1)),
    "warmup_cosine": ({}, optim.cosine_decay_schedule(LR, TOTAL)),
    "exponential": ({"transition_steps": 10, "decay_rate": 0.5}, optim.exponential_decay(LR, 10, 0.5)),
    "step": (
        {"step_size": 30, "gamma": 0.5},
        optim.piecewise_constant_schedule(LR, {30: 0.5, 60: 0.5, 90: 0.5}),
    ),
    "piecewise": ({"boundaries_and_scales": {"50": 0.1}}, optim.piecewise_constant_schedule(LR, {50: 0.1})),
    "polynomial": ({"power": 2.0}, optim.polynomial_schedule(LR, 0.0, 2.0, TOTAL)),
    "one_cycle": ({"pct_start": 0.25}, optim.one_cycle_schedule(TOTAL, LR, pct_start=0.25)),
}


def test_the_config_accepts_exactly_the_names_the_table_builds():
    assert tuple(SCHEDULES) == SCHEDULER_NAMES
    assert set(EXPECTED) == set(SCHEDULES)  # this test covers every schedule


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_named_schedule_is_the_optim_schedule(name: str):
    args, expected = EXPECTED[name]
    config = ft.TrainerConfig(max_steps=TOTAL, optimizer={"lr": LR}, scheduler={"name": name, "args": args})
    built = build.schedule(config, TOTAL)
    for count in (0, 1, 29, 30, 50, 77, 99):
        assert float(built(count)) == pytest.approx(float(expected(count)), rel=1e-6), count


def test_unused_schedule_arguments_are_refused():
    config = ft.TrainerConfig(max_steps=TOTAL, scheduler={"name": "linear", "args": {"power": 2.0}})
    with pytest.raises(ft.config.ConfigError, match=r"unused arguments \['power'\]"):
        build.schedule(config, TOTAL)


def test_loggers_follow_the_config(tmp_path: Path):
    config = ft.TrainerConfig(max_steps=1, output_dir=str(tmp_path), csv=True, tensorboard=True, jsonl=False)
    pytest.importorskip("torch.utils.tensorboard")
    writers = build.loggers(config, tmp_path / "logs")
    try:
        assert [type(w).__name__ for w in writers] == ["CSVWriter", "TensorBoardWriter"]
    finally:
        for w in writers:
            w.close()
