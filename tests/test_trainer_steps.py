"""The Trainer's steps are real steps (issue 32, item 3): values with their model, metrics and settling
forward as fields, which ``ft.jit`` reads; so every path ``ft.jit`` takes for a model (the RNN rewrite,
Hugging Face's checkpoint routing, the attention fast path, the settling forward) is the Trainer's too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import TinyTransformer
from test_trainer_hf import tiny_bert, token_dataset
from torch import nn
from trainer_fixtures import SmallNet, make_dataset, quiet_config

import functrain as ft


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 11, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


def tokens(n: int, seed: int = 0, vocab: int = 11, length: int = 6) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    return torch.utils.data.TensorDataset(x, x[:, 0] % 3)


def train_compiled(tmp_path: Path, model: nn.Module, train: Any, val: Any, **fields: Any) -> ft.Trainer:
    """One epoch of 3 steps through ``Trainer(compile=True)``, evaluated at its end."""
    config = quiet_config(tmp_path, epochs=1, batch_size=16, compile=True, metrics=["accuracy"], **fields)
    trainer = ft.Trainer(model, config, train_dataset=train, eval_dataset=val)
    result = trainer.train()
    assert int(result.state.step) == 3
    assert result.history.series("eval/accuracy")  # evaluated at the epoch's end
    return trainer


def compiles(trainer: ft.Trainer) -> dict[str, int]:
    return {kind: step.num_compiles for kind, step in trainer._jitted.items()}


@pytest.mark.compile
def test_an_lstm_classifier_compiles_once_per_step_in_the_trainer(tmp_path: Path):
    # On main: GraphBreakError "Attempted to wrap RNN, GRU, or LSTM" (no model for jit's RNN rewrite).
    trainer = train_compiled(tmp_path, LSTMClassifier(), tokens(48), tokens(16, seed=1))
    assert compiles(trainer) == {"train": 1, "eval": 1}


@pytest.mark.compile
def test_a_transformer_encoder_compiles_once_per_step_in_the_trainer(tmp_path: Path):
    trainer = train_compiled(tmp_path, TinyTransformer(vocab=11), tokens(48), tokens(16, seed=1))
    assert compiles(trainer) == {"train": 1, "eval": 1}


@pytest.mark.compile
def test_a_hf_bert_compiles_once_per_step_in_the_trainer(tmp_path: Path):
    model = tiny_bert()
    assert model.config.problem_type is None  # settled by the steps' eager forward, before the trace
    trainer = train_compiled(tmp_path, model, token_dataset(48), token_dataset(16, seed=1))
    assert compiles(trainer) == {"train": 1, "eval": 1}
    assert model.config.problem_type == "single_label_classification"


# ------------------------------------------------------------------------------------ the steps' fields


def _trainer(tmp_path: Path, cls: type[ft.Trainer] = ft.Trainer) -> ft.Trainer:
    config = quiet_config(tmp_path, epochs=1, metrics=["accuracy"])
    return cls(SmallNet(), config, train_dataset=make_dataset(32), eval_dataset=make_dataset(16, seed=1))


def test_the_trainers_compiled_steps_are_the_steps_it_built(tmp_path: Path):
    trainer = _trainer(tmp_path)
    train, evaluate = trainer._jit("train"), trainer._jit("eval")
    assert train.step.kind == "train" and evaluate.step.kind == "eval"
    assert train.step.model is trainer.model and evaluate.step.model is trainer.model
    assert train.step.settle is not None  # the training forward jit runs once before the first trace
    assert evaluate.step.metrics is trainer.metrics
    assert not train.step.masked_batches and evaluate.step.masked_batches  # pad_train/eval_batches


def test_an_overridden_train_step_keeps_the_model_and_gets_its_batches_as_they_are(tmp_path: Path):
    calls = []

    class Counting(ft.Trainer):
        def train_step(self, state, batch):
            calls.append(len(batch[0]))
            return super().train_step(state, batch)

    trainer = _trainer(tmp_path, Counting)
    step = trainer._jit("train")
    assert step.step.model is trainer.model and step.step.kind == "train"
    assert step.step.settle is not None and not step.step.masked_batches
    trainer.train()
    assert calls == [16, 16]  # the override ran, as compiled (eager here)
