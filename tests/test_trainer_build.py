"""The Trainer's builders (functrain.trainer.build): the schedule table is the config's list of names, and
each name builds the functrain.optim schedule it stands for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    "cosine_with_min_lr": ({"min_lr": LR / 10}, optim.cosine_decay_schedule(LR, TOTAL, alpha=0.1)),
    "cosine_with_restarts": ({"num_cycles": 1}, optim.cosine_decay_schedule(LR, TOTAL)),
    "inverse_sqrt": ({"timescale": 10}, lambda count: torch.tensor(LR * (10 / (count + 10)) ** 0.5)),
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


# Hugging Face's lr_scheduler_type names functrain accepts, with scheduler.args (HF's
# lr_scheduler_kwargs): HF's "constant" has no warm-up whatever warmup_steps says.
HF_SCHEDULES = {
    "linear": {},
    "cosine": {},
    "cosine_with_restarts": {"num_cycles": 3},
    "cosine_with_min_lr": {"min_lr_rate": 0.2},
    "polynomial": {"lr_end": 1e-7, "power": 2.0},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {},
}


@pytest.mark.parametrize("warmup", [0, 10])
@pytest.mark.parametrize("name", list(HF_SCHEDULES))
def test_hugging_face_schedule_names_give_hugging_faces_learning_rates(name: str, warmup: int):
    transformers = pytest.importorskip("transformers")  # the reference (a dev extra)
    args = HF_SCHEDULES[name]
    warmup = 0 if name == "constant" else warmup
    config = ft.TrainerConfig(
        max_steps=TOTAL, optimizer={"lr": LR}, scheduler={"name": name, "warmup_steps": warmup, "args": args}
    )
    built = build.schedule(config, TOTAL)
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    reference = transformers.get_scheduler(
        name, torch_opt, num_warmup_steps=warmup, num_training_steps=TOTAL, scheduler_specific_kwargs=args
    )
    for count in range(TOTAL):  # the rate of the count-th update, as torch_opt.step() would use it
        assert float(built(count)) == pytest.approx(
            torch_opt.param_groups[0]["lr"], rel=1e-6, abs=LR * 1e-6
        ), count
        torch_opt.step()
        reference.step()


@pytest.mark.parametrize("alias", ["adamw_torch", "adamw_torch_fused", "adamw_hf", "ADAMW_TORCH"])
def test_hugging_face_optimizer_names_build_the_same_optimizer(alias: str):
    config = ft.TrainerConfig(max_steps=3, optimizer={"name": alias, "lr": LR, "weight_decay": 0.1})
    assert config.optimizer.name == "adamw"  # the resolved config holds functrain's name
    canonical = ft.TrainerConfig(max_steps=3, optimizer={"name": "adamw", "lr": LR, "weight_decay": 0.1})
    params = {"w": torch.randn(3, generator=torch.Generator().manual_seed(0))}
    txs = [build.optimizer(c, LR, params, set()) for c in (config, canonical)]
    states = [tx.init(params) for tx in txs]
    for step in range(3):
        grads = {"w": torch.randn(3, generator=torch.Generator().manual_seed(step + 1))}
        updates = []
        for i, tx in enumerate(txs):
            update, states[i] = tx.update(grads, states[i], params)
            updates.append(update["w"])
        assert torch.equal(updates[0], updates[1]), step


@pytest.mark.parametrize(
    ("section", "name", "needle"),
    [
        ("optimizer", "adafactor", "use adamw, the nearest"),
        ("optimizer", "adamw_bnb_8bit", "use adamw (full-precision states)"),
        ("optimizer", "lion_32bit", "args: {b2: 0.999}"),
        ("scheduler", "reduce_lr_on_plateau", "set_hyperparams"),
    ],
)
def test_hugging_face_names_functrain_does_not_build_are_refused_naming_the_nearest(section, name, needle):
    with pytest.raises(ft.config.ConfigError) as info:
        ft.TrainerConfig(max_steps=3, **{section: name})
    (problem,) = info.value.problems
    assert problem.path == f"{section}.name" and needle in problem.fix, problem


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
