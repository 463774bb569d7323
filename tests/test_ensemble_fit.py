"""Ensembles in the loop: per-member scalars in history and logs, monitors on a member or the best, one
checkpoint for all members, and bit-exact resume (eager, a small MLP)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from models import mlp

import functrain as ft
from functrain import tree

LOSS = ft.supervised_loss(F.cross_entropy)
LRS = [1e-3, 1e-2, 3e-2]


def _data(n: int = 96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def _setup(dropout: float = 0.0):
    model = mlp(dropout=dropout)
    collection = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    state = ft.ensemble.create(
        model,
        ft.optim.adam(1e-2),
        seeds=[0, 1, 2],
        hyperparams={"learning_rate": LRS},
        metrics=collection.empty(),
    )
    train_step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS, metrics=collection)), compile=False)
    eval_step = ft.jit(
        ft.ensemble.eval_step(ft.make_eval_step(model, LOSS, metrics=collection)), compile=False
    )
    return model, collection, state, train_step, eval_step


def test_fit_records_every_members_scalars_and_evaluates_each_member(tmp_path):
    model, collection, state, train_step, eval_step = _setup()
    data = _data()
    result = ft.fit(
        state,
        train_step,
        data,
        batch_size=16,
        epochs=2,
        eval_step=eval_step,
        eval_data=data,
        log_steps=3,
        loggers=[
            ft.logging.JSONLWriter(tmp_path),
            ft.logging.CSVWriter(tmp_path),
            ft.logging.TensorBoardWriter(tmp_path / "tb"),
        ],
        callbacks=[ft.callbacks.LearningRateMonitor()],
        progress_bar=False,
    )
    names = result.history.names()
    for key in (
        "train/loss",
        "train/loss/best",
        "train/loss/member_2",
        "train/accuracy/member_0",
        "lr/member_1",
    ):
        assert key in names, key
    ev = result.eval_metrics
    losses = [ev[f"eval/loss/member_{i}"] for i in range(3)]
    assert ev["eval/loss/best"] == min(losses) and ev["eval/loss/worst"] == max(losses)
    assert abs(ev["eval/loss"] - sum(losses) / 3) < 1e-6
    assert result.history.latest("lr/member_2") == pytest.approx(LRS[2])
    # each member's numbers are that member's, evaluated alone
    single_eval = ft.make_eval_step(model, LOSS, metrics=collection)
    for i in range(3):
        alone = ft.evaluate(ft.ensemble.member(result.state, i), single_eval, data, batch_size=16)
        assert alone["eval/loss"] == pytest.approx(ev[f"eval/loss/member_{i}"], abs=1e-6)
        assert alone["eval/accuracy"] == pytest.approx(ev[f"eval/accuracy/member_{i}"], abs=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/accuracy/member_1" in row for row in rows)
    assert "train/loss/member_0" in (tmp_path / "metrics.csv").read_text().splitlines()[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/loss/member_2", "eval/accuracy/best", "train/loss/member_1", "train/loss"} <= tags
    last = events.Scalars("eval/accuracy/member_1")[-1].value
    assert last == pytest.approx(ev["eval/accuracy/member_1"])


def test_monitors_follow_a_member_or_the_best_and_one_checkpoint_holds_all(tmp_path):
    _, _, state, train_step, eval_step = _setup()
    data = _data()
    saver = ft.callbacks.ModelCheckpoint(tmp_path / "ckpt", monitor="eval/accuracy/member_2", mode="max")
    stopper = ft.callbacks.EarlyStopping("eval/loss/best", patience=1, min_delta=10.0)
    result = ft.fit(
        state,
        train_step,
        data,
        batch_size=16,
        epochs=5,
        eval_step=eval_step,
        eval_data=data,
        callbacks=[saver, stopper],
        progress_bar=False,
    )
    assert (
        "eval/loss/best did not improve" in result.stop_reason
    )  # min_delta=10: never improves after the first
    assert (
        int(result.state.step[0]) == 2 * 6 and stopper.best == result.history.series("eval/loss/best")[0][1]
    )
    best = saver.manager.best()
    assert best is not None
    raw = saver.manager.restore("best")
    assert raw["state"]["params"]["0.weight"].shape == (3, 16, 8)


class _StopAt(ft.callbacks.Callback):
    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_step_end(self, state, ctx):
        if ctx.step == self.at:
            ctx.control.stop("interrupted", final=False)  # resumable, as preemption
        return state


def _run(run_dir, stop_at=None, resume=False):
    _, _, state, train_step, eval_step = _setup(dropout=0.3)
    data = _data()
    return ft.fit(
        state,
        train_step,
        data,
        batch_size=16,
        epochs=3,
        eval_step=eval_step,
        eval_data=data,
        eval_every=4,
        log_steps=5,
        callbacks=[_StopAt(stop_at)],
        loggers=[ft.logging.JSONLWriter(run_dir)],
        checkpoints=run_dir / "ckpt",
        resume_from_checkpoint=resume,
        progress_bar=False,
    )


@pytest.mark.parametrize("stop_at", [3, 8, 12])  # mid-epoch (6 batches per epoch), after an eval, epoch end
def test_resume_is_bit_identical(tmp_path, stop_at):
    reference = _run(tmp_path / "ref")
    stopped = _run(tmp_path / "run", stop_at=stop_at)
    assert int(stopped.state.step[0]) == stop_at
    resumed = _run(tmp_path / "run", resume=True)
    la, lb = tree.leaves(reference.state), tree.leaves(resumed.state)
    assert tree.paths(reference.state) == tree.paths(resumed.state)
    for path, x, y in zip(tree.paths(reference.state), la, lb):
        assert torch.equal(x, y), path
    assert reference.history.as_dict() == resumed.history.as_dict()
    assert (tmp_path / "ref" / "metrics.jsonl").read_text() == (
        tmp_path / "run" / "metrics.jsonl"
    ).read_text()


def test_fit_refuses_an_ensemble_state_with_a_single_model_step():
    model, _, state, _, _ = _setup()
    plain = ft.jit(ft.make_train_step(model, LOSS), compile=False)
    with pytest.raises(ValueError, match=r"ensemble of 3 members.*ft.ensemble.step"):
        ft.fit(state, plain, _data(), batch_size=16, epochs=1, progress_bar=False)
    ens_step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS)), compile=False)
    single = ft.TrainState.create(model, ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="not an ensemble state"):
        ft.fit(single, ens_step, _data(), batch_size=16, epochs=1, progress_bar=False)
