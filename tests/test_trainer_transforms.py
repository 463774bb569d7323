"""The Trainer's config fields for the transforms of the step: DP-SGD (dp_l2_norm_clip,
dp_noise_multiplier, dp_target_epsilon, dp_delta) and SAM (sam_rho)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_fixtures import SmallNet, make_dataset, quiet_config

import functrain as ft
from functrain.config import ConfigError
from functrain.optim import privacy


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def test_dp_sgd_from_the_config_aggregates_per_example_gradients(tmp_path: Path) -> None:
    cfg = quiet_config(tmp_path, epochs=1, dp_l2_norm_clip=1.0, dp_noise_multiplier=0.5, optimizer="sgd")
    trainer = ft.Trainer(_mlp(), cfg, train_dataset=make_dataset(64))
    trainer.train()
    dp_state = trainer.state.opt_state[0]
    assert isinstance(dp_state, ft.optim.DifferentiallyPrivateAggregateState)
    assert int(dp_state.count) == 4  # 64 examples / 16 per batch, each through the aggregate


def test_dp_sgd_refuses_batchnorm_naming_the_module(tmp_path: Path) -> None:
    cfg = quiet_config(tmp_path, epochs=1, dp_l2_norm_clip=1.0, dp_noise_multiplier=0.5)
    with pytest.raises(ValueError, match=r"BatchNorm1d 'body\.1'"):
        ft.Trainer(SmallNet(), cfg, train_dataset=make_dataset(64))


def test_dp_target_epsilon_asks_the_accountant_with_the_run_s_sampling_rate_and_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = []

    def accountant(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
        asked.append((target_epsilon, delta, sample_rate, steps))
        return 0.8

    monkeypatch.setattr(privacy, "noise_multiplier_for_epsilon", accountant)
    cfg = quiet_config(tmp_path, epochs=2, dp_l2_norm_clip=1.0, dp_target_epsilon=4.0, dp_delta=1e-4)
    ft.Trainer(_mlp(), cfg, train_dataset=make_dataset(64))
    assert asked == [(4.0, 1e-4, 16 / 64, 8)]


def test_dp_target_epsilon_without_opacus_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "opacus", None)  # import opacus raises ImportError
    cfg = quiet_config(tmp_path, epochs=1, dp_l2_norm_clip=1.0, dp_target_epsilon=4.0)
    with pytest.raises(ConfigError, match=r"dp_target_epsilon.*functrain\[privacy\]"):
        ft.Trainer(_mlp(), cfg, train_dataset=make_dataset(64))


def test_the_accountant_s_noise_multiplier_spends_the_target_epsilon() -> None:
    pytest.importorskip("opacus")  # the optional extra functrain[privacy]
    sigma = privacy.noise_multiplier_for_epsilon(3.0, 1e-5, 256 / 60_000, 2_340)
    assert privacy.epsilon(sigma, 256 / 60_000, 2_340, 1e-5) <= 3.0 + 1e-2
    assert privacy.epsilon(sigma * 0.8, 256 / 60_000, 2_340, 1e-5) > 3.0


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"dp_l2_norm_clip": 1.0}, "dp_l2_norm_clip"),
        ({"dp_noise_multiplier": 1.0}, "dp_noise_multiplier"),
        ({"dp_l2_norm_clip": 1.0, "dp_noise_multiplier": 1.0, "dp_target_epsilon": 3.0}, "dp_l2_norm_clip"),
        (
            {"dp_l2_norm_clip": 1.0, "dp_noise_multiplier": 1.0, "gradient_accumulation_steps": 2},
            "gradient_accumulation_steps",
        ),
        ({"dp_l2_norm_clip": 1.0, "dp_noise_multiplier": 1.0, "sam_rho": 0.05}, "sam_rho"),
        (
            {"dp_l2_norm_clip": 1.0, "dp_noise_multiplier": 1.0, "pad_train_batches": True},
            "pad_train_batches",
        ),
        ({"sam_rho": 0.05, "sharding": "params"}, "sam_rho"),
        ({"sam_rho": -1.0}, "sam_rho"),
    ],
)
def test_the_config_refuses_what_the_transforms_cannot_do(fields: dict, name: str) -> None:
    with pytest.raises(ConfigError) as err:
        ft.TrainerConfig(max_steps=3, **fields)
    assert [p.path for p in err.value.problems] == [name]


def test_sam_from_the_config_changes_the_update(tmp_path: Path) -> None:
    def train(**fields: object) -> dict[str, torch.Tensor]:
        cfg = quiet_config(tmp_path / str(len(fields)), max_steps=3, optimizer="sgd", seed=0, **fields)
        trainer = ft.Trainer(_mlp(), cfg, train_dataset=make_dataset(64))
        trainer.train()
        return trainer.state.params

    plain, sam = train(), train(sam_rho=0.5)
    assert float((plain["0.weight"] - sam["0.weight"]).abs().max()) > 1e-6
