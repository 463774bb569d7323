"""``fit``: fold a compiled train step over the batches, the host work done by a :class:`Run`.

The loop: the batches, the step, and the :class:`Run` before and after it
(callbacks, logging, evaluation and checkpoints when due). ``fit``'s parameters become one checked
:class:`~functrain.loop.options.FitOptions`. The package's docstring has a runnable example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from functrain.callbacks.base import Callback
from functrain.logging import History
from functrain.loop.length import RunLength
from functrain.loop.options import FitOptions
from functrain.loop.run import Run
from functrain.loop.state import FitResult

__all__ = ["fit"]


def fit(
    state: Any,
    train_step: Callable[[Any, Any], tuple[Any, Mapping[str, torch.Tensor]]],
    train_data: Any,
    *,
    eval_step: Callable[[Any, Any], Mapping[str, Any]] | None = None,
    eval_data: Any = None,
    epochs: int | None = None,
    max_steps: int | None = None,
    additional_epochs: int | None = None,
    additional_steps: int | None = None,
    batch_size: int | None = None,
    eval_batch_size: int | None = None,
    eval_every: int | str | None = "epoch",
    log_steps: int = 50,
    callbacks: Iterable[Callback] = (),
    loggers: Iterable[Any] = (),
    checkpoints: Any = None,
    save_every: int | str | None = None,
    save_final: bool = True,
    resume_from_checkpoint: bool | int | str = False,
    progress_bar: bool = True,
    history: History | None = None,
    check_batches: Literal["first", "every"] = "first",
) -> FitResult:
    """Train: fold ``train_step`` over ``train_data`` for ``epochs`` or ``max_steps`` optimizer steps.

    Args:
        state: the initial train state (ignored in favour of the checkpoint when resuming).
        train_step: ``(state, batch) -> (state, metrics)``, usually ``jit(make_train_step(...))``.
        train_data: a :class:`functrain.data.Loader`, a torch ``DataLoader``, or a dataset with
            ``batch_size`` (shuffled per epoch with a key derived from ``state.rng``; a stream, such as an
            ``IterableDataset``, read in its own order). Batches are moved to the state's device (on CUDA:
            pinned, copied ahead of the step); a ``Loader`` given its own ``device`` keeps it. A resume
            reads the data in the checkpoint's order (its key, whatever ``state`` was made with), and a
            stream from its saved state or by a checked replay (:mod:`functrain.loop.data_resume`).
        eval_step, eval_data, eval_batch_size: evaluation (``make_eval_step``) and its data.
        epochs, max_steps: the run's length, counted from step 0 (at least one; the run ends at
            whichever comes first). They count the *whole* run, not more of it, so the same call resumes
            a run to the same end; a state already there returns at once with a
            :class:`RunFinishedWarning`. To train more, raise them (``epochs=done + n``) or use:
        additional_epochs, additional_steps: instead of ``epochs``/``max_steps``, train this many more
            epochs or optimizer steps from where the state (or the resumed checkpoint) stands. A run
            stopped mid-epoch counts the rest of that epoch as the first additional one. They also
            continue a run that was stopped for good (by early stopping); rerunning the same call trains
            more again.
        eval_every: a number of steps, ``"epoch"`` or ``None``.
        log_steps: log (and sync the host) every this many optimizer steps; also at epoch ends
            (``TrainerConfig.log_steps``).
        callbacks: :class:`functrain.callbacks.Callback` objects for this run.
        loggers: writers with ``write(step, scalars)`` (``functrain.logging``: console, JSONL, CSV,
            TensorBoard).
        checkpoints: a :class:`functrain.checkpoint.CheckpointManager` (or a directory for one).
        save_every: a number of steps, ``"epoch"`` or ``None``.
        save_final: also save the final state (``TrainerConfig.save_strategy: no`` turns it off). A
            run stopped by :class:`functrain.callbacks.Preemption` saves where it stopped either way.
        resume_from_checkpoint: ``True`` resumes from the latest checkpoint if there is one (else starts
            fresh), a step number or ``"best"`` from that checkpoint, a path from that checkpoint file;
            ``False`` starts fresh. A resumed run that had ended (its length reached, early stopping or
            another final stop request) returns its final state at once, trains and logs nothing, and
            warns why (:class:`RunFinishedWarning`). Without resume, a state that has already taken steps continues
            the data stream where its step count puts it. (``TrainerConfig.resume_from_checkpoint``, and
            Hugging Face's ``Trainer.train(resume_from_checkpoint=)``.)
        progress_bar: show a progress bar (``tqdm.auto``: terminal and notebook), as
            ``TrainerConfig.progress_bar``.
        check_batches: a tensor-parallel state (``tensor_parallel(...).place``) trains each tp group's
            ranks on one batch: the data is sliced by the dp rank only, and a digest of the batch is
            compared over the group (one small collective; raises naming the ranks) on the ``"first"``
            step of the call, or on ``"every"`` step (a debug setting: it reads each batch back to the
            host); ``TrainerConfig.tensor_parallel_check_batches``.

    Returns:
        :class:`FitResult` with the final state, the history and the last evaluation.

    Example:
        >>> import tempfile, torch, functrain as ft
        >>> model = torch.nn.Linear(4, 2)
        >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
        >>> train_step = ft.jit(ft.make_train_step(model, loss_fn), compile=False)
        >>> eval_step = ft.jit(ft.make_eval_step(model, loss_fn), compile=False)
        >>> run_dir = tempfile.TemporaryDirectory()
        >>> run = dict(batch_size=16, eval_step=eval_step, eval_data=data[:32], progress_bar=False,
        ...            checkpoints=run_dir.name, resume_from_checkpoint=True)
        >>> result = ft.fit(state, train_step, data, epochs=2, **run)
        >>> int(result.state.step), sorted(result.eval_metrics)
        (8, ['eval/loss'])
        >>> int(ft.fit(state, train_step, data, epochs=3, **run).state.step)  # resumed at step 8
        12
        >>> run_dir.cleanup()
    """
    options = FitOptions(
        RunLength(epochs, max_steps, additional_epochs, additional_steps),
        batch_size=batch_size,
        eval_step=eval_step,
        eval_data=eval_data,
        eval_batch_size=eval_batch_size,
        eval_every=eval_every,
        save_every=save_every,
        log_steps=log_steps,
        resume=resume_from_checkpoint,
        progress_bar=progress_bar,
        callbacks=tuple(callbacks),
        loggers=tuple(loggers),
        checkpoints=checkpoints,
        history=history,
        check_batches=check_batches,
    )
    run, state = Run.start(state, train_step, train_data, options)  # checked, resumed; train_begin fired
    return _loop(run, state, train_step, save_final)


def _loop(run: Run, state: Any, train_step: Callable[..., Any], save_final: bool) -> FitResult:
    """The loop itself: each batch, the step, and ``run`` before and after it, until the data or the run
    ends; then the final save. The run is closed whatever happens."""
    try:
        for batch in run.batches():
            state = run.before_step(state, batch)  # epoch_begin, step_begin
            state, metrics = train_step(state, batch)
            state = run.after_step(state, metrics)  # step_end; log, eval, save when due
            if run.stopping:
                break
        if save_final:
            state = run.save_last(state)
    finally:
        run.close()
    return run.finish(state)
