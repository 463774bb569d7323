"""One compile per step whatever the data (issue 33, item 2): the Trainer's defaults compile the train and
eval steps once each for any dataset length (the short last batch runs eagerly: exact, BatchNorm
included), for a Hugging Face model that switches between training and evaluation every epoch
(transformers 5.x's ``PreTrainedModel.train`` reads the mode it changes), and a bounded few times for
variable-length sequences (:mod:`functrain.data.sequences`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_hf import tiny_bert, token_dataset
from torch import nn
from trainer_fixtures import make_dataset, quiet_config

import functrain as ft


def compiles(trainer: ft.Trainer) -> dict[str, int]:
    return {kind: step.num_compiles for kind, step in trainer._jitted.items()}


def _train(tmp_path: Path, model: nn.Module, train: Any, val: Any = None, **fields: Any) -> ft.Trainer:
    config = quiet_config(tmp_path, **{"epochs": 2, "batch_size": 16, **fields})
    trainer = ft.Trainer(model, config, train_dataset=train, eval_dataset=val)
    trainer.train()
    return trainer


@pytest.mark.compile
def test_a_hf_bert_evaluated_every_epoch_with_a_short_last_batch_compiles_each_step_once(tmp_path: Path):
    # 40 examples: batches of 16, 16 and 8; evaluated after each of the 2 epochs (train -> eval -> train)
    trainer = _train(tmp_path, tiny_bert(), token_dataset(40), token_dataset(20, seed=1), compile=True)
    assert int(trainer.state.step) == 6
    assert compiles(trainer) == {"train": 1, "eval": 1}, [s.compile_reasons for s in trainer._jitted.values()]


def _batchnorm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.compile
def test_a_short_last_batch_through_batchnorm_compiles_once_and_is_exact(tmp_path: Path):
    data = make_dataset(40)  # a last batch of 8: its own batch statistics, as eagerly
    states = {}
    # SGD: Adam would turn the rounding noise of the zero gradient of the bias before BatchNorm into +-lr
    sgd = {"name": "sgd", "lr": 0.1}
    for compile in (False, True):
        trainer = _train(
            tmp_path / str(compile), _batchnorm_net(), data, compile=compile, epochs=1, optimizer=sgd
        )
        states[compile] = trainer.state
    assert compiles(trainer) == {"train": 1}
    for field in ("params", "buffers"):
        for name, eager in getattr(states[False], field).items():
            torch.testing.assert_close(getattr(states[True], field)[name], eager, rtol=1e-5, atol=1e-6)


def _ragged_tokens(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Token sequences of 3 to 14 tokens (no padding yet), labelled by their first token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 15, (n,), generator=g).tolist()
    out = []
    for length in lengths:
        ids = torch.randint(1, 30, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids[0] % 3})
    return out


@pytest.mark.compile
def test_a_pad_to_longest_collate_compiles_once_per_length_bucket(tmp_path: Path):
    train = _ragged_tokens(64)
    longest = {max(len(s["input_ids"]) for s in train[i : i + 4]) for i in range(0, 64, 4)}
    assert len(longest) >= 5  # as they come, as many compiles (on main: one per length)
    config = quiet_config(tmp_path, epochs=1, batch_size=4, compile=True, sequence_bucket=8, shuffle=False)
    trainer = ft.Trainer(tiny_bert(), config, train_dataset=train, data_collator=ft.data.pad_to_longest)
    trainer.train()
    assert {ft.data.bucket_length(n, 8) for n in longest} == {8, 16}
    assert compiles(trainer) == {"train": 2}
