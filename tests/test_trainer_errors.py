"""Mistakes in the user's own code give eager's errors with ``compile=True`` too (issue 33, item 3): the
step's settling forward runs eagerly before dynamo traces anything and lets the exception through as it
is, a traceback ending at the user's line, with no dynamo traceback chained to it or stack grown onto
its message."""

from __future__ import annotations

import copy
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_trainer_hf import tiny_bert
from trainer_fixtures import make_dataset, quiet_config

import functrain as ft


def indexing_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])  # the mistake: the batch is a tuple


def per_example_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")  # the mistake: not reduced to a scalar


def _errors(tmp_path: Path, model: torch.nn.Module, data: Any, kind: type, **kwargs: Any) -> BaseException:
    """The error of ``Trainer.train`` with ``compile=True``, checked to be eager's: the same type and message
    as with ``compile=False``, nothing traced, no dynamo exception as its cause, no traced stack in its
    message."""
    errors = {}
    for compile in (False, True):
        config = quiet_config(tmp_path / str(compile), epochs=1, compile=compile)
        trainer = ft.Trainer(copy.deepcopy(model), config, train_dataset=data, **kwargs)
        with pytest.raises(kind) as info:
            trainer.train()
        assert all(step.num_compiles == 0 for step in trainer._jitted.values())
        errors[compile] = info.value
    error = errors[True]
    assert type(error) is type(errors[False]) and str(error) == str(errors[False])
    assert error.__cause__ is None and (error.__suppress_context__ or error.__context__ is None)
    assert "from user code" not in str(error) and len(str(error)) < 400, str(error)[:400]
    return error


@pytest.mark.compile
def test_an_error_in_the_users_loss_ends_at_their_line_compiled_as_eagerly(tmp_path: Path):
    error = _errors(tmp_path, torch.nn.Linear(6, 3), make_dataset(32), TypeError, loss_fn=indexing_loss)
    last = traceback.extract_tb(error.__traceback__)[-1]
    assert (last.filename, last.name) == (__file__, "indexing_loss") and 'batch["x"]' in last.line


@pytest.mark.compile
def test_a_non_scalar_loss_is_refused_before_the_trace(tmp_path: Path):
    error = _errors(tmp_path, torch.nn.Linear(6, 3), make_dataset(32), ValueError, loss_fn=per_example_loss)
    assert "the loss must be a 0-d tensor" in str(error)


@pytest.mark.compile
def test_a_hf_model_given_a_tensor_dataset_is_told_what_batches_it_needs(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 30, (32, 8), generator=g)
    data = torch.utils.data.TensorDataset(ids, ids[:, 0] % 3)
    message = str(_errors(tmp_path, tiny_bert(), data, TypeError))
    assert "SequenceClassifierOutput" in message and "'labels'" in message and "loss_fn" in message
