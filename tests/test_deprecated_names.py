"""One name per concept: the old names still work for one release, warn, and never mean something else.

fit's ``log_every``/``resume`` are ``log_steps``/``resume_from_checkpoint`` (TrainerConfig's and Hugging
Face's names); the config's ``loss`` section is ``criterion`` (``Trainer(criterion=)``'s name).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from models import classification_batch, mlp

import functrain as ft
from functrain.cli import main
from functrain.config import ConfigError, CriterionConfig, LossConfig, TrainerConfig


def _setup():
    torch.manual_seed(0)
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)), compile=False)
    return state, step, list(zip(*classification_batch(40, seed=0)))


class _LogSteps(ft.callbacks.Callback):
    def on_train_begin(self, state, ctx):
        self.seen = ctx.log_steps
        with pytest.warns(DeprecationWarning, match="Context.log_steps"):
            self.old = ctx.log_every
        return state

    def on_checkpoint_restored(self, state, ctx):
        self.restored_at = int(state.step)
        return state


def test_fit_log_every_and_resume_are_the_old_names_of_log_steps_and_resume_from_checkpoint(tmp_path):
    state, step, data = _setup()
    run = dict(batch_size=8, progress_bar=False)
    new_cb = _LogSteps()
    first = ft.fit(
        state, step, data, epochs=1, log_steps=3, callbacks=[new_cb], checkpoints=tmp_path / "a", **run
    )
    assert new_cb.seen == new_cb.old == 3
    assert [s for s, _ in first.history.series("train/loss")] == [3, 5]  # every 3 steps and the epoch end
    ft.fit(state, step, data, epochs=1, checkpoints=tmp_path / "b", **run)

    def resumed(directory: str, callback: _LogSteps, **names: object) -> ft.FitResult:
        return ft.fit(
            state,
            step,
            data,
            epochs=2,
            callbacks=[callback],
            checkpoints=tmp_path / directory,
            **run,
            **names,
        )

    old_cb, new_cb_resumed = _LogSteps(), _LogSteps()
    with (
        pytest.warns(DeprecationWarning, match=r"fit\(log_every=...\) is deprecated.*log_steps"),
        pytest.warns(DeprecationWarning, match=r"fit\(resume=...\).*resume_from_checkpoint"),
    ):
        old = resumed("a", old_cb, log_every=3, resume=True)
    assert old_cb.seen == 3 and int(old.state.step) == 10
    new = resumed("b", new_cb_resumed, log_steps=3, resume_from_checkpoint=True)
    torch.testing.assert_close(new.state.params, old.state.params, rtol=0, atol=0)
    assert old_cb.restored_at == new_cb_resumed.restored_at == 5  # both resumed the step-5 checkpoint


def test_fit_refuses_an_old_and_a_new_name_together():
    state, step, data = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=r"give log_steps=... only \(log_every= is its deprecated name\)"):
            ft.fit(state, step, data, batch_size=8, epochs=1, log_every=3, log_steps=4)
        with pytest.raises(TypeError, match=r"give resume_from_checkpoint=\.\.\. only"):
            ft.fit(state, step, data, batch_size=8, epochs=1, resume=True, resume_from_checkpoint="best")


def test_config_loss_is_the_old_name_of_criterion_in_mappings_files_and_overrides():
    new = TrainerConfig(epochs=1, criterion={"name": "MSELoss", "args": {"reduction": "sum"}})
    with pytest.warns(DeprecationWarning, match="'loss' is deprecated.*write 'criterion'"):
        assert TrainerConfig(epochs=1, loss={"name": "MSELoss", "args": {"reduction": "sum"}}) == new
    with pytest.warns(DeprecationWarning, match="'loss' is deprecated"):
        assert TrainerConfig.from_yaml("epochs: 1\nloss: {name: MSELoss, args: {reduction: sum}}") == new
    base = TrainerConfig(epochs=1)
    with pytest.warns(DeprecationWarning, match="'loss' is deprecated"):
        assert base.with_overrides(["loss.name=MSELoss", "loss.args.reduction=sum"]) == new
    assert base.with_overrides(["criterion.name=MSELoss", "criterion.args.reduction=sum"]) == new
    assert "loss" not in new.to_dict() and new.to_dict()["criterion"]["name"] == "MSELoss"
    assert LossConfig is CriterionConfig


def test_an_old_file_takes_overrides_of_either_name(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 1\nloss: {name: MSELoss}\n")
    from functrain.config.overrides import apply_overrides

    with pytest.warns(DeprecationWarning):
        data = apply_overrides(
            {"epochs": 1, "loss": {"name": "MSELoss"}}, ["criterion.args.reduction=sum"], TrainerConfig
        )
    assert data == {"epochs": 1, "criterion": {"name": "MSELoss", "args": {"reduction": "sum"}}}


def test_config_refuses_loss_and_criterion_together_and_names_the_line(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(
            ConfigError, match="loss: is the deprecated name of criterion, which is given too"
        ):
            TrainerConfig(epochs=1, loss="MSELoss", criterion="L1Loss")
        with pytest.raises(ConfigError, match=r"criterion.name \(line 2\): unknown torch.nn loss 'MSELos'"):
            TrainerConfig.from_yaml("epochs: 1\nloss: MSELos\n")


def test_the_cli_says_once_that_a_run_yaml_uses_an_old_name(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 1\nloss: MSELos\nmodel: nosuchmod:Net\ntrain_dataset: nosuchmod:data\n")
    assert main(["train", str(path), "eval_strategy=no"]) == 2
    err = capsys.readouterr().err.splitlines()
    old_name = [line for line in err if "deprecated" in line]
    assert old_name == [
        "functrain train: the config field 'loss' is deprecated and goes in the next release: write 'criterion'"
    ]
    assert "criterion.name (line 2): unknown torch.nn loss 'MSELos'" in err[-1]
