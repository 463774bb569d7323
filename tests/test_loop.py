"""fit / evaluate / predict: event order, control requests, exact metrics, logs, errors (eager steps)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from models import classification_batch, mlp

import functrain as ft


def dataset(n=50, seed=0):
    """``n`` (x, y) examples: models.classification_batch as a list."""
    return list(zip(*classification_batch(n, seed=seed)))


def setup(dropout=0.0):
    torch.manual_seed(0)
    model = mlp(dropout=dropout)
    loss_fn = ft.supervised_loss(F.cross_entropy)
    metrics = ft.metrics.Collection(
        {
            "accuracy": ft.metrics.Accuracy(),
            "f1": ft.metrics.from_torchmetrics("F1Score", task="multiclass", num_classes=3, average="macro"),
        }
    )
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
    train_step = ft.jit(ft.make_train_step(model, loss_fn), compile=False)
    eval_step = ft.jit(ft.make_eval_step(model, loss_fn, metrics=metrics), compile=False)
    return model, state, train_step, eval_step


class Recorder(ft.callbacks.Callback):
    def __init__(self, stop_at=None, save_at=None, eval_at=None):
        self.events = []
        self.stop_at, self.save_at, self.eval_at = stop_at, save_at, eval_at

    def _record(self, event):
        def handler(state, ctx):
            self.events.append((event, ctx.step))
            if event == "step_end":
                if ctx.step == self.stop_at:
                    ctx.control.stop("recorder asked")
                if ctx.step == self.save_at:
                    ctx.control.save()
                if ctx.step == self.eval_at:
                    ctx.control.evaluate()
            return state

        return handler

    def __getattribute__(self, name):
        if name.startswith("on_") and name[3:] in ft.callbacks.EVENTS:
            return self._record(name[3:])
        return super().__getattribute__(name)


def test_events_fire_in_the_documented_order(tmp_path):
    _, state, train_step, eval_step = setup()
    rec = Recorder()
    run = dict(
        batch_size=16,
        eval_step=eval_step,
        eval_data=dataset(20, seed=1),
        eval_batch_size=10,
        checkpoints=tmp_path / "ckpt",
        save_every="epoch",
        progress_bar=False,
    )
    ft.fit(state, train_step, dataset(40), epochs=2, callbacks=[rec], **run)
    names = [e for e, _ in rec.events]
    one_epoch = (
        ["epoch_begin"]
        + ["step_begin", "step_end"] * 3
        + ["epoch_end", "eval_begin"]
        + ["eval_batch_begin", "eval_batch_end"] * 2
        + ["eval_end", "checkpoint_saved"]
    )
    assert names == ["train_begin", *one_epoch, *one_epoch, "train_end"]
    # resuming fires checkpoint_restored right after train_begin, and continues at the saved step
    rec2 = Recorder()
    result = ft.fit(
        state, train_step, dataset(40), epochs=3, resume_from_checkpoint=True, callbacks=[rec2], **run
    )
    assert rec2.events[:3] == [("train_begin", 6), ("checkpoint_restored", 6), ("epoch_begin", 6)]
    assert int(result.state.step) == 9


def test_stop_save_and_evaluate_requests_are_honoured(tmp_path):
    _, state, train_step, eval_step = setup()
    rec = Recorder(stop_at=5, save_at=2, eval_at=3)
    manager = ft.checkpoint.CheckpointManager(tmp_path / "ckpt")
    result = ft.fit(
        state,
        train_step,
        dataset(80),
        batch_size=8,
        epochs=3,
        eval_step=eval_step,
        eval_data=dataset(20),
        eval_every=None,
        checkpoints=manager,
        callbacks=[rec],
        progress_bar=False,
    )
    assert int(result.state.step) == 5 and result.stop_reason == "recorder asked"
    assert manager.all_steps() == [2, 5]  # the requested save, and the final state
    evals = [s for e, s in rec.events if e == "eval_end"]
    assert evals == [3]
    assert result.eval_metrics is not None


def test_callback_must_return_the_state():
    _, state, train_step, _ = setup()
    bad = ft.callbacks.LambdaCallback(on_step_end=lambda s, ctx: None)
    with pytest.raises(TypeError, match="must return the state"):
        ft.fit(state, train_step, dataset(16), batch_size=8, max_steps=1, callbacks=[bad], progress_bar=False)


def test_evaluate_equals_torchmetrics_on_the_whole_set_with_a_short_last_batch():
    model, state, _, eval_step = setup()
    data = dataset(53, seed=3)  # batches of 16: 16, 16, 16, 5
    results = ft.evaluate(state, eval_step, data, batch_size=16)
    x = torch.stack([d[0] for d in data])
    y = torch.stack([d[1] for d in data])
    model.load_state_dict(state.state_dict())
    model.eval()
    with torch.no_grad():
        logits = model(x)
    acc = torchmetrics.functional.accuracy(logits, y, task="multiclass", num_classes=3)
    f1 = torchmetrics.functional.f1_score(logits, y, task="multiclass", num_classes=3, average="macro")
    assert results["eval/accuracy"] == pytest.approx(float(acc), abs=1e-6)
    assert results["eval/f1"] == pytest.approx(float(f1), abs=1e-6)
    assert results["eval/loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)


def test_predict_streams_and_collects():
    _, state, _, _ = setup()
    step = ft.make_predict_step(setup()[0])
    data = [d[0] for d in dataset(21)]
    streamed = list(ft.predict(state, step, data, batch_size=8))
    assert [s.shape[0] for s in streamed] == [8, 8, 5]
    collected = ft.predict(state, step, data, batch_size=8, collect=True)
    assert torch.equal(collected, torch.cat(streamed))


def test_logs_reach_jsonl_csv_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, state, train_step, eval_step = setup()
    loggers = [
        ft.logging.JSONLWriter(tmp_path),
        ft.logging.CSVWriter(tmp_path),
        ft.logging.TensorBoardWriter(tmp_path / "tb"),
    ]
    ft.fit(
        state,
        train_step,
        dataset(48),
        batch_size=8,
        epochs=2,
        log_steps=4,
        eval_step=eval_step,
        eval_data=dataset(16),
        callbacks=[ft.callbacks.LearningRateMonitor()],
        loggers=loggers,
        progress_bar=False,
    )
    for lg in loggers:
        lg.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [4, 6, 8, 12]  # every 4 steps and at each epoch's end (6 batches)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [6, 12]
    assert all("lr" in r for r in records if "train/loss" in r)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "eval/loss", "eval/accuracy", "lr"} <= set(tags)
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [6, 12]
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "step" in header and "train/loss" in header


def test_fit_argument_errors_are_explained():
    _, state, train_step, eval_step = setup()
    with pytest.raises(ValueError, match=r"epochs=\.\.\. or max_steps"):
        ft.fit(state, train_step, dataset(8), batch_size=4, progress_bar=False)
    with pytest.raises(ValueError, match="eval_step and eval_data"):
        ft.fit(state, train_step, dataset(8), batch_size=4, epochs=1, eval_step=eval_step, progress_bar=False)
    with pytest.raises(ValueError, match="batch_size"):
        ft.fit(state, train_step, dataset(8), epochs=1, progress_bar=False)


def test_early_stopping_stops_and_restores_best():
    _, state, train_step, eval_step = setup()
    stopper = ft.callbacks.EarlyStopping("eval/loss", patience=2, min_delta=10.0, restore_best=True)
    result = ft.fit(
        state,
        train_step,
        dataset(32),
        batch_size=8,
        epochs=10,
        eval_step=eval_step,
        eval_data=dataset(16, seed=2),
        callbacks=[stopper],
        progress_bar=False,
    )
    # min_delta is huge: only the first evaluation counts as an improvement, two more exhaust patience
    assert int(result.state.step) == 3 * 4 and "early stopping" in result.stop_reason
    assert stopper.best_step == 4
    assert torch.equal(result.state.params["0.weight"], stopper.best_weights["params"]["0.weight"])


def test_non_finite_guard_names_the_step():
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    step = ft.jit(
        ft.make_train_step(model, lambda call, b: F.cross_entropy(call(b[0]), b[1]) * float("nan")),
        compile=False,
    )
    guard = ft.callbacks.NonFiniteGuard(action="stop")
    result = ft.fit(state, step, dataset(16), batch_size=8, epochs=1, callbacks=[guard], progress_bar=False)
    assert "step 1" in result.stop_reason and guard.bad_steps == [1]
    assert torch.equal(result.state.params["0.weight"], state.params["0.weight"]), (
        "the bad update is not kept"
    )


# ------------------------------------------------------------------ a finished run stays finished


def _early_stopped_run(tmp_path, **extra):
    """An early-stopped run: min_delta so large that nothing counts as an improvement."""
    _, state, train_step, eval_step = setup()
    stopper = ft.callbacks.EarlyStopping("eval/loss", patience=2, min_delta=1e9)
    run = dict(
        batch_size=8,
        eval_step=eval_step,
        eval_data=dataset(16, seed=1),
        checkpoints=tmp_path / "ckpt",
        save_every="epoch",
        loggers=[ft.logging.JSONLWriter(tmp_path / "logs")],
        progress_bar=False,
    )
    run.update(extra)
    return state, train_step, stopper, run


def test_resume_of_an_early_stopped_run_returns_it_at_once_and_says_why(tmp_path):
    state, train_step, stopper, run = _early_stopped_run(tmp_path, resume_from_checkpoint=True)
    first = ft.fit(state, train_step, dataset(40), epochs=10, callbacks=[stopper], **run)
    # the first evaluation sets `best`, then two without improvement: stopped after epoch 3 (5 steps each)
    assert int(first.state.step) == 15 and first.stop_reason.startswith("early stopping")
    logs = (tmp_path / "logs" / "metrics.jsonl").read_text()
    saved = ft.checkpoint.CheckpointManager(tmp_path / "ckpt").all_steps()

    stopper2 = ft.callbacks.EarlyStopping("eval/loss", patience=2, min_delta=1e9)
    run["loggers"] = [ft.logging.JSONLWriter(tmp_path / "logs")]
    with pytest.warns(
        ft.RunFinishedWarning, match=r"stopped for good at step 15: early stopping.*additional_epochs"
    ):
        again = ft.fit(state, train_step, dataset(40), epochs=10, callbacks=[stopper2], **run)
    assert int(again.state.step) == 15 and again.stop_reason == first.stop_reason
    assert (tmp_path / "logs" / "metrics.jsonl").read_text() == logs  # nothing appended
    assert ft.checkpoint.CheckpointManager(tmp_path / "ckpt").all_steps() == saved
    assert all(torch.equal(again.state.params[k], first.state.params[k]) for k in first.state.params)

    # an explicit request trains on: one more epoch from step 15
    run["loggers"] = [ft.logging.JSONLWriter(tmp_path / "logs")]
    more = ft.fit(state, train_step, dataset(40), additional_epochs=1, callbacks=[stopper2], **run)
    assert int(more.state.step) == 20


def test_resume_of_a_run_that_reached_its_length_trains_nothing(tmp_path):
    _, state, train_step, _ = setup()
    run = dict(batch_size=8, checkpoints=tmp_path / "ckpt", progress_bar=False)
    first = ft.fit(
        state, train_step, dataset(40), epochs=2, loggers=[ft.logging.JSONLWriter(tmp_path / "l")], **run
    )
    logs = (tmp_path / "l" / "metrics.jsonl").read_text()
    with pytest.warns(
        ft.RunFinishedWarning, match=r"at step 10, and epochs=2 ends the run at step 10.*epochs=3"
    ):
        again = ft.fit(
            state,
            train_step,
            dataset(40),
            epochs=2,
            resume_from_checkpoint=True,
            loggers=[ft.logging.JSONLWriter(tmp_path / "l")],
            **run,
        )
    assert int(again.state.step) == 10 and again.stop_reason == ""
    assert (tmp_path / "l" / "metrics.jsonl").read_text() == logs
    assert torch.equal(again.state.params["0.weight"], first.state.params["0.weight"])
    assert (
        int(ft.fit(state, train_step, dataset(40), epochs=3, resume_from_checkpoint=True, **run).state.step)
        == 15
    )


def test_fit_again_on_a_finished_state_warns_and_additional_epochs_trains_more():
    _, state, train_step, _ = setup()
    data = dataset(40)
    first = ft.fit(state, train_step, data, batch_size=8, epochs=1, progress_bar=False)
    with pytest.warns(ft.RunFinishedWarning, match=r"count the whole run.*epochs=2, additional_epochs=N"):
        same = ft.fit(first.state, train_step, data, batch_size=8, epochs=1, progress_bar=False)
    assert same.state is first.state or int(same.state.step) == 5
    more = ft.fit(first.state, train_step, data, batch_size=8, additional_epochs=2, progress_bar=False)
    # two more epochs, continuing the data stream (epochs 1 and 2), as one 3-epoch run does
    whole = ft.fit(state, train_step, data, batch_size=8, epochs=3, progress_bar=False)
    assert int(more.state.step) == 15
    assert all(torch.equal(more.state.params[k], whole.state.params[k]) for k in whole.state.params)
    steps = ft.fit(first.state, train_step, data, batch_size=8, additional_steps=3, progress_bar=False)
    assert int(steps.state.step) == 8
    with pytest.raises(ValueError, match="not several"):
        ft.fit(first.state, train_step, data, batch_size=8, epochs=2, additional_epochs=1)


def test_a_non_final_stop_leaves_the_run_resumable(tmp_path):
    _, state, train_step, _ = setup()

    class Pause(ft.callbacks.Callback):
        def on_step_end(self, state, ctx):
            if ctx.step == 3:
                ctx.control.stop("paused", final=False)
            return state

    run = dict(
        batch_size=8, epochs=2, checkpoints=tmp_path / "ckpt", resume_from_checkpoint=True, progress_bar=False
    )
    assert ft.fit(state, train_step, dataset(40), callbacks=[Pause()], **run).stop_reason == "paused"
    assert int(ft.fit(state, train_step, dataset(40), **run).state.step) == 10


def test_timer_eta_leaves_windows_with_a_compilation_out(monkeypatch):
    """A compile takes minutes once; an ETA from a window holding one would predict hours."""
    from functrain.callbacks import monitors

    clock = iter([0.0, 100.0, 101.0, 150.0])  # train_begin, then three logging steps
    monkeypatch.setattr(monitors.time, "perf_counter", lambda: next(clock))
    timer = ft.callbacks.Timer()
    ctx = ft.callbacks.Context(max_steps=100, history=ft.logging.History())
    timer.on_train_begin(None, ctx)
    for step in range(1, 31):
        ctx.step, ctx.logging_step = step, step % 10 == 0
        ctx.compiles = 1 if step < 21 else 2  # the first step compiles; an evaluation compiles after step 20
        timer.on_step_end(None, ctx)
    # window 1 (99 s of compiling): no ETA; window 2: 10 steps/s, 80 steps left; window 3 compiled: the
    # ETA keeps window 2's rate (70 steps left), not 10 steps / 49 s
    assert ctx.history.series("time/eta_s") == [(20, 8.0), (30, 7.0)]
    assert [s for s, _ in ctx.history.series("time/steps_per_s")] == [10, 20, 30]


def test_timer_counts_a_step_compiled_before_this_fit_as_compiled():
    """A second fit with a step compiled by the first: its first window is steady, so it has an ETA."""
    _, state, train_step, _ = setup()

    def compiled_earlier(state, batch):
        return train_step(state, batch)

    compiled_earlier.num_compiles = 1  # as a CompiledStep that compiled in an earlier fit
    result = ft.fit(
        state, compiled_earlier, dataset(40), batch_size=8, epochs=1, log_steps=2, progress_bar=False,
        callbacks=[ft.callbacks.Timer()],
    )  # fmt: skip
    assert [s for s, _ in result.history.series("time/eta_s")][:1] == [2]


def test_a_plain_dataloader_without_resume_does_not_warn():
    import warnings

    _, state, train_step, _ = setup()
    loader = torch.utils.data.DataLoader(dataset(40), batch_size=8, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ResumeWarning included: nothing is resumed here
        result = ft.fit(state, train_step, loader, epochs=1, progress_bar=False)
    assert int(result.state.step) == 5


def test_a_final_stop_stays_final_whatever_the_callback_order():
    from functrain.callbacks.base import Control

    for calls in (
        [("patience exhausted", True), ("preempted", False)],
        [("preempted", False), ("done", True)],
    ):
        control = Control()
        for reason, final in calls:
            control.stop(reason, final=final)
        assert control.should_stop and control.stop_is_final
    control = Control()
    control.stop("preempted", final=False)
    assert control.should_stop and not control.stop_is_final


def test_callbacks_read_fits_log_steps_from_the_context():
    class Seen(ft.callbacks.Callback):
        def on_train_begin(self, state, ctx):
            self.log_steps = ctx.log_steps
            return state

    _, state, train_step, _ = setup()
    seen = Seen()
    ft.fit(
        state,
        train_step,
        dataset(40),
        batch_size=8,
        epochs=1,
        log_steps=3,
        callbacks=[seen],
        progress_bar=False,
    )
    assert seen.log_steps == 3
