"""loop/run.py and loop/options.py: fit's parameters as one checked FitOptions; a Run made ready by
Run.start (checked, resumed, train_begin fired) whose fields are all set there, one step count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models import classification_batch, mlp

import functrain as ft
from functrain.loop.options import FitOptions
from functrain.loop.run import Phase, Progress, Run, Services


def _setup():
    torch.manual_seed(0)
    model = mlp()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)), compile=False)
    return state, step, list(zip(*classification_batch(40, seed=0)))


class Begins(ft.callbacks.Callback):
    def __init__(self):
        self.seen = []

    def on_train_begin(self, state, ctx):
        self.seen.append(("train_begin", ctx.step, ctx.max_steps))
        return state

    def on_checkpoint_restored(self, state, ctx):
        self.seen.append(("checkpoint_restored", ctx.step, ctx.checkpoint_path))
        return state


def _loop(run, state, train_step):
    """fit's loop, as fit writes it."""
    try:
        for batch in run.batches():
            state = run.before_step(state, batch)
            state, metrics = train_step(state, batch)
            state = run.after_step(state, metrics)
            if run.stopping:
                break
        state = run.save_last(state)
    finally:
        run.close()
    return run.finish(state)


def test_fit_options_is_frozen_and_checked_when_made():
    options = FitOptions(ft.loop.RunLength(epochs=2), batch_size=8, eval_every=4, save_every="epoch")
    assert options.evals == ft.loop.Every()  # no eval_step: never evaluates, eval_every not read
    assert options.saves == ft.loop.Every(epoch=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.log_steps = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="log_steps must be a positive int, got 0"):
        FitOptions(ft.loop.RunLength(epochs=2), log_steps=0)
    with pytest.raises(ValueError, match="eval_step and eval_data go together"):
        FitOptions(ft.loop.RunLength(epochs=2), eval_data=[1])
    with pytest.raises(ValueError, match="save_every must be a positive number of steps"):
        FitOptions(ft.loop.RunLength(epochs=2), save_every="sometimes")


def test_run_start_returns_a_ready_run_whose_fields_are_all_set_there(tmp_path):
    state, train_step, data = _setup()
    begins = Begins()
    options = FitOptions(
        ft.loop.RunLength(epochs=2),
        batch_size=8,
        callbacks=(begins,),
        checkpoints=tmp_path / "ckpt",
        progress_bar=False,
    )
    run, state = Run.start(state, train_step, data, options)
    assert begins.seen == [("train_begin", 0, 10)]  # fired by start: no order left to the caller
    assert isinstance(run.progress, Progress) and isinstance(run.services, Services)
    assert (run.progress.step, run.progress.total, run.progress.phase) == (0, 10, Phase.TRAINING)
    fields = {f.name for f in dataclasses.fields(Run)}
    result = _loop(run, state, train_step)
    assert set(vars(run)) == fields  # nothing was added to the run after it was made
    # one step count: the run's, which the callbacks' context and the state agree with
    assert run.progress.step == run.ctx.step == int(result.state.step) == 10
    assert run.progress.phase is Phase.STOPPING and run.progress.last_saved == 10

    begins2 = Begins()
    options2 = dataclasses.replace(
        options, callbacks=(begins2,), resume=True, length=ft.loop.RunLength(epochs=3)
    )
    run2, _ = Run.start(state, train_step, data, options2)
    path = ft.checkpoint.CheckpointManager(tmp_path / "ckpt").path(10)
    assert run2.restored_path == path and run2.progress.step == 10 and run2.progress.total == 15
    assert begins2.seen == [("train_begin", 10, 15), ("checkpoint_restored", 10, path)]
    run2.close()


def test_a_run_stopped_for_good_starts_idle_with_its_reason_typed(tmp_path):
    state, train_step, data = _setup()

    class StopForGood(ft.callbacks.Callback):
        def on_step_end(self, state, ctx):
            if ctx.step == 3:
                ctx.control.stop("enough", final=True)
            return state

    options = FitOptions(
        ft.loop.RunLength(epochs=2),
        batch_size=8,
        callbacks=(StopForGood(),),
        checkpoints=tmp_path / "ckpt",
        progress_bar=False,
    )
    run, state = Run.start(state, train_step, data, options)
    first = _loop(run, state, train_step)
    assert run.progress.finished == "enough" and first.stop_reason == "enough"

    with pytest.warns(ft.RunFinishedWarning, match="stopped for good at step 3: enough"):
        again, _ = Run.start(state, train_step, data, dataclasses.replace(options, resume=True))
    assert again.progress.phase is Phase.IDLE and again.progress.finished == "enough"
    assert list(again.batches()) == [] and again.finish(state).stop_reason == "enough"

    more, _ = Run.start(
        state,
        train_step,
        data,
        dataclasses.replace(options, resume=True, length=ft.loop.RunLength(additional_steps=1)),
    )
    assert more.progress.phase is Phase.TRAINING and more.progress.finished is None  # may go on again
    more.close()
