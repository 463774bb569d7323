"""A :class:`Run`: everything around ``fit``'s loop that is not the step.

It checks the arguments, opens the loader, resumes (the state, the data position, the callbacks, the
history), keeps the context the callbacks read, and does the periodic work when it is due: log, evaluate,
save (:class:`~functrain.loop.schedule.Every`). ``fit`` itself is the loop::

    run = Run.open(state, train_step, train_data, ...)
    state = run.begin(run.resume(state))
    for batch in run.batches():
        state = run.before_step(state, batch)
        state, metrics = train_step(state, batch)
        state = run.after_step(state, metrics)
        ...
    return run.finish(state)
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from functrain import distributed
from functrain.callbacks.base import Callback, Context
from functrain.checkpoint.onto import restore_onto
from functrain.data import DataPosition
from functrain.ensemble.stacked import run_step
from functrain.logging import History
from functrain.logging.writer import as_writer
from functrain.loop.data import as_loader, batch_device, data_key, noting_steps
from functrain.loop.data_resume import DataResume
from functrain.loop.evaluate import evaluate
from functrain.loop.events import Events, callback_names
from functrain.loop.length import RunLength
from functrain.loop.schedule import Every
from functrain.loop.state import FitResult, LoopState, RunFinishedWarning
from functrain.loop.window import Window
from functrain.step import as_step

__all__ = ["Run"]


class Run:
    """One ``fit`` call's host side. Made by :meth:`open` (which checks everything before any step);
    ``resume``, ``begin``, then per batch ``before_step``/``after_step`` and the due work; ``finish``."""

    def __init__(self, train_step: Callable[..., Any], loader: Any, length: RunLength, **fields: Any) -> None:
        self.train_step, self.loader, self.length = train_step, loader, length
        self.spec = as_step(train_step)
        self.eval_step: Any = fields["eval_step"]
        self.eval_data, self.eval_batch_size = fields["eval_data"], fields["eval_batch_size"]
        self.log_steps: int = fields["log_steps"]
        self.eval_every: Every = fields["eval_every"]
        self.save_every: Every = fields["save_every"]
        self.callbacks: list[Callback] = fields["callbacks"]
        self.loggers = fields["loggers"]
        self.manager = fields["manager"]
        self.auto_bar = fields["auto_bar"]
        self.names = callback_names(self.callbacks)
        self.events = Events(self.callbacks)
        self.history: History = fields["history"]
        self.bpe: int | None = loader.batches_per_epoch
        self.naming = self.spec.naming(fields["state"])
        self.window = Window(self.naming)
        self.position = DataPosition()
        self.ctx = Context(batches_per_epoch=self.bpe, log_steps=self.log_steps, history=self.history)
        jit = sys.modules.get("functrain.jit")  # loaded wherever a step is a CompiledStep
        compiled = jit.CompiledStep if jit is not None else ()
        self.compiled = [s for s in (train_step, self.eval_step) if isinstance(s, compiled)]
        self.donated = bool(self.compiled) and self.compiled[0] is train_step and train_step.donate
        self.finished = ""  # why the run ended for good: recorded in its checkpoints
        self.restored_path: str | None = None
        self.nothing_to_do = ""
        self.stop_reason = ""
        self.stopping = False
        self._stream: Any = None
        self._batches: Any = None
        self._index = 0
        self._next: DataPosition = self.position
        self.data = DataResume(loader)  # what checkpoints keep of the data besides its position

    # ------------------------------------------------------------------------------ open and resume

    @classmethod
    def open(
        cls,
        state: Any,
        train_step: Callable[..., Any],
        train_data: Any,
        length: RunLength,
        *,
        eval_step: Any,
        eval_data: Any,
        batch_size: int | None,
        eval_batch_size: int | None,
        eval_every: int | str | None,
        log_steps: int,
        save_every: int | str | None,
        callbacks: Iterable[Callback],
        loggers: Iterable[Any],
        checkpoints: Any,
        progress_bar: bool,
        history: History | None,
    ) -> Run:
        """Check the arguments and open the training data: every refusal comes before the first step."""
        from functrain.callbacks.progress import ProgressBar

        if not isinstance(log_steps, int) or isinstance(log_steps, bool) or log_steps < 1:
            raise ValueError(f"fit: log_steps must be a positive int, got {log_steps!r}")
        if (eval_step is None) != (eval_data is None):
            raise ValueError("fit: eval_step and eval_data go together (give both or neither)")
        evals = Every.parse(eval_every if eval_step is not None else None, "eval_every")
        saves = Every.parse(save_every, "save_every")
        loader = as_loader(
            train_data,
            batch_size,
            data_key(state),
            "fit",
            shuffle=True,
            shard=True,
            device=batch_device(state),
        )
        loader.require_batches("fit")  # before any step: zero steps is never a finished run
        as_step(train_step).check(state, "fit")
        if length.counts_epochs and loader.batches_per_epoch is None:
            raise ValueError(
                "fit: the training data has no length, so epochs cannot be counted; use max_steps "
                "(or additional_steps)"
            )
        callbacks = list(callbacks)
        manager = _as_manager(checkpoints, callbacks)
        main = distributed.is_main_process()  # only rank 0 shows progress and writes logs
        auto_bar = None
        if progress_bar and main and not any(isinstance(cb, ProgressBar) for cb in callbacks):
            auto_bar = ProgressBar()
            callbacks.append(auto_bar)
        return cls(
            train_step,
            loader,
            length,
            state=state,
            eval_step=eval_step,
            eval_data=eval_data,
            eval_batch_size=eval_batch_size or batch_size,
            log_steps=log_steps,
            eval_every=evals,
            save_every=saves,
            callbacks=callbacks,
            loggers=[as_writer(lg) for lg in loggers] if main else [],
            manager=manager,
            auto_bar=auto_bar,
            history=history if history is not None else History(),
        )

    def resume(self, state: Any, resume: bool | int | str) -> Any:
        """The state to train from: restored (with the loop's own state) from a checkpoint when
        ``resume`` says so and there is one, else ``state``; then this call's length is resolved."""
        manager = self.manager
        resume_file = isinstance(resume, str | os.PathLike) and os.path.isfile(resume)
        if resume is not False and (manager is not None or resume_file):
            which = "latest" if resume is True else resume
            if resume_file or manager.latest() is not None:
                from functrain.checkpoint import restore

                raw = restore(resume) if resume_file else manager.restore(which)
                state = self._restore(state, raw)
                if resume_file:
                    self.restored_path = os.fspath(resume)
                else:
                    step = (
                        manager.latest()
                        if which == "latest"
                        else manager.best()
                        if which == "best"
                        else which
                    )
                    self.restored_path = manager.path(step)
        elif resume is not False and manager is None:
            raise ValueError("fit: resume needs checkpoints=CheckpointManager(...) (or a directory)")
        self.step = run_step(state)
        if self.restored_path is None and self.step > 0 and self.bpe is not None:
            self.position = DataPosition.from_batch_count(self.step, self.bpe)  # continue the stream
        self.num_epochs, self.total = self.length.resolve(self.bpe, self.step, self.position)
        self.ctx.step, self.ctx.max_steps = self.step, self.total
        self.nothing_to_do = self.length.nothing_to_do(self.finished, self.step, self.total, self.bpe)
        if self.nothing_to_do:
            warnings.warn(self.nothing_to_do, RunFinishedWarning, stacklevel=3)  # at fit's caller
            self.events = Events([cb for cb in self.callbacks if cb is not self.auto_bar])
            self.stop_reason = self.finished
        elif self.length.extending:
            self.finished = ""
        if self.restored_path is not None:
            from functrain.checkpoint.file import read_header

            layout = distributed.loader_layout(self.loader)
            distributed.check_resume(read_header(self.restored_path).metadata, layout)
            if distributed.is_main_process():
                print(f"resumed from step {self.step} ({self.restored_path})", file=sys.stderr, flush=True)
        for lg in self.loggers:
            lg.resume_from(self.step if self.restored_path is not None else None)
        return state

    def _restore(self, state: Any, raw: Any) -> Any:
        state = restore_onto(state, raw["state"])
        saved = raw["loop"]
        self.position = DataPosition(saved["position"]["epoch"], saved["position"]["index"])
        for n, cb in zip(self.names, self.callbacks):
            if n in saved["callbacks"]:
                cb.load_state_dict(saved["callbacks"][n])
        self.history = History.from_dict(json.loads(saved["history"]))
        self.ctx.history = self.history
        self.window = Window.from_json(saved["window"], state.params, self.naming)
        self.finished = str(saved.get("finished", ""))
        self.loader = self.data.restore(saved, self.position)
        return state

    def begin(self, state: Any) -> Any:
        """Fire ``train_begin`` (and ``checkpoint_restored`` after a resume)."""
        self.ctx.compiles = self.compiles()  # steps compiled by an earlier fit count as compiled already
        state = self.events("train_begin", state, self.ctx)
        if self.restored_path is not None:
            self.ctx.checkpoint_path = self.restored_path
            state = self.events("checkpoint_restored", state, self.ctx)
        self.last_saved = self.step if self.restored_path is not None or self.nothing_to_do else -1
        return state

    # ------------------------------------------------------------------------------ the steps

    def batches(self) -> Iterator[Any]:
        """This call's training batches, from where the data stream stands (none when there is nothing to
        do); the loop's position advances with each step."""
        if self.nothing_to_do:
            return iter(())
        start, check = self.data.start(self.position)  # a replayed stream: one batch early, checked
        stream = self.loader.iterate(start, num_epochs=self.num_epochs)
        self._stream = noting_steps(stream, lambda: self.step + 1)
        self._batches = self._arriving(self._stream, check)
        return self._batches

    def _arriving(self, stream: Iterator[Any], check: str) -> Iterator[Any]:
        for position, batch in stream:
            if check:
                self.loader.check_replay(batch, check, *self.position.as_tuple())
                check = ""
                continue
            self._next = position
            yield batch

    def before_step(self, state: Any, batch: Any) -> Any:
        """``epoch_begin`` at an epoch's first batch, then ``step_begin``."""
        ctx = self.ctx
        epoch, index = self._next.as_tuple()
        self._index = index
        ctx.epoch, ctx.batch_index = epoch, index - 1
        if index == 1:
            state = self.events("epoch_begin", state, ctx)
        ctx.batch = batch
        self.data.saw(batch)
        state = self.events("step_begin", state, ctx)
        ctx.previous_state = None if self.donated else state
        return state

    def after_step(self, state: Any, metrics: Any) -> Any:
        """Count the step, fire ``step_end``, then log, end the epoch, evaluate and save when due."""
        ctx = self.ctx
        self.step += 1
        self.position, index = self._next, self._index
        ctx.step, ctx.batch_index, ctx.metrics = self.step, index, metrics
        ctx.compiles = self.compiles()
        self.window.add(metrics)
        epoch_done = self.bpe is not None and index == self.bpe
        ctx.logging_step = self.step % self.log_steps == 0 or epoch_done or self.step >= self.total
        state = self.events("step_end", state, ctx)
        ctx.previous_state = None
        control = ctx.control
        if control.should_log or ctx.logging_step:
            state = self.log(state)
        if epoch_done:
            state = self.events("epoch_end", state, ctx)
        if self.eval_step is not None and (
            self.eval_every.due(self.step, epoch_done) or control.should_evaluate
        ):
            state = self.evaluate(state)
        self.stopping = control.should_stop
        self.stop_reason = control.stop_reason if self.stopping else ""
        if self.stopping and control.stop_is_final:
            self.finished = self.stop_reason or "a callback stopped the run"  # saved: stays finished
        if self.save_every.due(self.step, epoch_done) or control.should_save:
            state = self.save(state)
        ctx.control = type(control)()
        ctx.batch = None
        self.stopping = self.stopping or self.step >= self.total
        return state

    def compiles(self) -> int:
        return sum(step.num_compiles for step in self.compiled)

    # ------------------------------------------------------------------------------ the periodic work

    def log(self, state: Any) -> Any:
        """Log the window's averages and the train metrics (one sync), then reset the train metrics."""
        scalars = self.window.flush()
        train_metrics = self.spec.metrics
        if train_metrics is not None and state.metrics is not None:
            merged = distributed.all_reduce_metric_state(train_metrics, state.metrics)
            scalars.update(self.naming.flatten("train", train_metrics.compute(merged)))
        self.history.put_scalars(self.naming.expand(scalars), self.step)
        floats = self.history.at(self.step)  # ours and what callbacks put, with one sync for all
        self.ctx.logs.update(floats)
        for lg in self.loggers:
            lg.write(self.step, floats)
        if train_metrics is None or state.metrics is None:
            return state
        return state.replace(metrics=train_metrics.empty(state.device))

    def evaluate(self, state: Any) -> Any:
        """Evaluate, log the results and fire ``eval_begin``/``eval_end``."""
        ctx = self.ctx
        state = self.events("eval_begin", state, ctx)
        results = evaluate(
            state,
            self.eval_step,
            self.eval_data,
            batch_size=self.eval_batch_size,
            callbacks=self.callbacks,
            ctx=ctx,
        )
        ctx.eval_metrics = results
        for k, v in results.items():
            self.history.put(k, v, self.step)
        ctx.logs.update(results)
        for lg in self.loggers:
            lg.write(self.step, results)
        return self.events("eval_end", state, ctx)

    def save(self, state: Any) -> Any:
        """Save the state with the loop's own (a checkpoint to resume from), when there is a manager."""
        self.last_saved = self.step
        if self.manager is None:
            return state
        loop = LoopState(
            position=self.position,
            callbacks={n: cb.state_dict() for n, cb in zip(self.names, self.callbacks)},
            history=json.dumps(self.history.as_dict()),
            window=self.window.to_json(),
            finished=self.finished,
            **self.data.fields(self.position),
        )
        tied = getattr(state, "tied", ())
        metadata = {"tied_parameters": dict(tied)} if tied else {}
        self.manager.save(
            self.step,
            {"state": state, "loop": loop},
            metrics=dict(self.ctx.eval_metrics or {}),
            metadata={**metadata, **distributed.loader_layout(self.loader)},
        )
        self.ctx.checkpoint_path = self.manager.path(self.step)
        return self.events("checkpoint_saved", state, self.ctx)

    # ------------------------------------------------------------------------------ the end

    def save_last(self, state: Any) -> Any:
        """Save the final state unless it was just saved."""
        return self.save(state) if self.manager is not None and self.last_saved != self.step else state

    def close(self) -> None:
        """Stop the prefetch thread now, flush the writers, wait for asynchronous saves."""
        if self._stream is not None:
            self._batches.close()
            self._stream.close()  # now, not when the generator is collected
        for lg in self.loggers:
            lg.flush()
        if self.manager is not None and hasattr(self.manager, "wait_until_finished"):
            self.manager.wait_until_finished()

    def finish(self, state: Any) -> FitResult:
        """Fire ``train_end``; the :class:`FitResult`."""
        state = self.events("train_end", state, self.ctx)
        return self.result(state)

    def result(self, state: Any) -> FitResult:
        return FitResult(
            state=state,
            history=self.history,
            eval_metrics=self.ctx.eval_metrics,
            stop_reason=self.stop_reason,
        )


def _as_manager(checkpoints: Any, callbacks: list[Callback]) -> Any:
    """A CheckpointManager from ``checkpoints`` (one, or a directory), else a ModelCheckpoint's."""
    if isinstance(checkpoints, str | os.PathLike):
        from functrain.checkpoint import CheckpointManager

        return CheckpointManager(checkpoints)
    if checkpoints is not None:
        return checkpoints
    from functrain.callbacks.checkpointing import ModelCheckpoint

    return next((cb.manager for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
