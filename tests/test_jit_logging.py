"""Logger calls inside a model do not break the compiled step's one graph (functrain.compile.quiet_logging)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

import functrain as ft
from functrain.compile.quiet_logging import ignored_logging, logging_methods

logger = logging.getLogger("tests.chatty_model")


@functools.lru_cache(None)
def _warning_once(self: logging.Logger, *args: object, **kwargs: object) -> None:
    # Hugging Face's transformers.utils.logging.warning_once, attached to logging.Logger the same way.
    self.warning(*args, **kwargs)


class ChattyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logger.warning("forward called with %d examples", x.shape[0])
        logger.warning_once("loss_type=None was set in the config but it is unrecognised")  # type: ignore[attr-defined]
        logger.info("info too")
        return self.linear(x)


@pytest.fixture
def warning_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.Logger, "warning_once", _warning_once, raising=False)


def test_logging_methods_include_library_additions(warning_once: None) -> None:
    methods = logging_methods()
    assert logging.Logger.warning in methods and logging.Logger.log in methods
    assert logging.Logger.warning_once in methods  # type: ignore[attr-defined]
    assert logging.Logger.isEnabledFor not in methods  # returns a value: never ignored


def test_ignored_logging_restores_dynamo_setting(warning_once: None) -> None:
    before = set(torch._dynamo.config.ignore_logging_functions)
    with ignored_logging():
        assert logging.Logger.warning_once in torch._dynamo.config.ignore_logging_functions  # type: ignore[attr-defined]
    assert torch._dynamo.config.ignore_logging_functions == before


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_step_with_logging_model_is_one_graph(warning_once: None) -> None:
    torch.manual_seed(0)
    model = ChattyModel()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy))
    compiled = ft.jit(step)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    out, _ = compiled(state, batch)
    out, _ = compiled(out, batch)
    assert compiled.num_compiles == 1
    ref, _ = step(state, batch)
    ref, _ = step(ref, batch)
    for name in ref.params:
        torch.testing.assert_close(out.params[name], ref.params[name])
