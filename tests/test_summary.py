"""functrain.summary: counts against torch's own, a hand-computed table, tied and frozen weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import functrain as ft


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.embed.weight  # tied: counted once, under embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(x))))


HAND_TABLE = """\
module  type         params  trainable  frozen  buffers  dtype          bytes
embed   Embedding        40         40       0        0  float32          160
proj    Linear           20          0      20        0  float32           80
norm    BatchNorm1d       8          8       0        9  float32,int64     72
head    Linear           10         10       0        0  float32           40
total                    78         58      20        9                   352
tied: head.weight is embed.weight (counted once)"""


def test_hand_computed_table_with_tied_and_frozen():
    s = ft.summary(Tiny(), frozen=["proj.*"])
    # 40 embed + 16 + 4 proj + 4 + 4 norm + 10 head bias; head.weight is embed.weight
    assert str(s) == HAND_TABLE
    assert s.tied == (("head.weight", "embed.weight"),)


def test_totals_match_torch_counts():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    model.layers[0].linear1.requires_grad_(False)
    s = ft.summary(model)
    params = list(model.parameters())
    assert s.total.params == sum(p.numel() for p in params)
    assert s.total.frozen == sum(p.numel() for p in params if not p.requires_grad) == 16 * 32 + 32
    assert s.total.trainable == sum(p.numel() for p in params if p.requires_grad)
    assert s.total.buffers == sum(b.numel() for b in model.buffers())
    expected_bytes = sum(t.numel() * t.element_size() for t in [*params, *model.buffers()])
    assert s.total.bytes == expected_bytes
    assert sum(r.params for r in s.rows) == s.total.params


def test_max_depth_groups_by_top_level_children():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    s = ft.summary(model, max_depth=2)
    assert [r.module for r in s.rows] == ["layers.0", "layers.1"]
    assert [r.type for r in s.rows] == ["TransformerEncoderLayer"] * 2
    assert s.rows[0].params == sum(p.numel() for p in model.layers[0].parameters())


def test_state_summary_uses_the_state_dtypes_and_a_freeze_mask():
    model = Tiny()
    mask = {name: name.startswith("proj.") for name, _ in model.named_parameters()}
    state = ft.TrainState.create(model, ft.optim.freeze(ft.optim.sgd(0.1), mask), dtype=torch.bfloat16)
    s = ft.summary(state, frozen=mask)
    assert (s.total.params, s.total.trainable, s.total.frozen, s.total.buffers) == (78, 58, 20, 9)
    assert s.total.bytes == 78 * 2 + 8 * 2 + 8  # bf16 params and running stats, int64 count
    assert s.tied == state.tied


def test_bad_frozen_names_and_targets_are_refused():
    with pytest.raises(ValueError, match=r"frozen names \['nope'\] are not parameters"):
        ft.summary(Tiny(), frozen={"nope": True})
    with pytest.raises(ValueError, match=r"summary: frozen .*pattern 'nope\.\*' matches no parameter"):
        ft.summary(Tiny(), frozen=["nope.*"])  # a typo, as freeze: [...] refuses it
    with pytest.raises(TypeError, match=r"summary: frozen .*a pattern must be a str glob"):
        ft.summary(Tiny(), frozen=[3])
    with pytest.raises(TypeError, match=r"expected an nn\.Module or a TrainState"):
        ft.summary({"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="max_depth must be an int >= 1"):
        ft.summary(Tiny(), max_depth=0)


def _config(tmp_path, **extra) -> dict:
    return {
        "output_dir": str(tmp_path / "run"),
        "model": "trainer_fixtures:SmallNet",
        "train_dataset": {"target": "trainer_fixtures:make_dataset", "kwargs": {"n": 32}},
        "max_steps": 2,
        "batch_size": 16,
        "compile": False,
        "progress_bar": False,
        "eval_strategy": "no",
        "save_strategy": "no",
        "device": "cpu",
        "freeze": ["body.0.*"],
        **extra,
    }


def test_trainer_prints_the_summary_at_train_start_unless_switched_off(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from trainer_fixtures import SmallNet, make_dataset

    cfg = {k: v for k, v in _config(tmp_path).items() if k not in ("model", "train_dataset")}
    ft.Trainer(SmallNet(), ft.TrainerConfig(**cfg), train_dataset=make_dataset(32)).train()
    out = capsys.readouterr().out
    expected = str(ft.summary(SmallNet(), frozen=["body.0.*"]))
    assert expected in out
    # 6 * 16 weights + 16 biases, all frozen by freeze: [body.0.*]
    assert expected.splitlines()[1].split() == ["body.0", "Linear", "112", "0", "112", "0", "float32", "448"]

    cfg.update(print_summary=False, overwrite_output_dir=True)
    ft.Trainer(SmallNet(), ft.TrainerConfig(**cfg), train_dataset=make_dataset(32)).train()
    assert "trainable" not in capsys.readouterr().out


def test_cli_summary_prints_the_table(tmp_path, capsys, monkeypatch):
    from functrain.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    path = tmp_path / "run.yaml"
    path.write_text(ft.TrainerConfig.from_dict(_config(tmp_path)).to_yaml())
    assert main(["summary", str(path), "--depth", "1"]) == 0
    out = capsys.readouterr().out
    from trainer_fixtures import SmallNet

    assert out.strip() == str(ft.summary(SmallNet(), frozen=["body.0.*"], max_depth=1))
    assert out.splitlines()[1].split()[:2] == ["body", "Sequential"]
