"""A :class:`Run`: everything around ``fit``'s loop that is not the step.

:meth:`Run.start` checks the arguments, opens the loader, resumes (the state, the data position, the
callbacks, the history) and fires ``train_begin``: the run it returns is ready, so nothing can be done out of
order. The run keeps the context the callbacks read and does the periodic work when it is due: log,
evaluate, save (:class:`~functrain.loop.schedule.Every`). ``fit`` itself is the loop::

    run, state = Run.start(state, train_step, train_data, options)
    for batch in run.batches():
        state = run.before_step(state, batch)
        state, metrics = train_step(state, batch)
        state = run.after_step(state, metrics)
        ...
    return run.finish(state)

Its fields are three small records besides the step and the logs: what ``fit`` was asked
(:class:`~functrain.loop.options.FitOptions`), what the run talks to (:class:`Services`) and where it stands
(:class:`Progress`, the one place of the step count).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import warnings
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from functrain import distributed
from functrain.callbacks.base import Callback, Context
from functrain.checkpoint.onto import restore_onto
from functrain.compile.tiers import TieredStep, TierPlan
from functrain.data import DataPosition, Loader
from functrain.distributed.data_ranks import DataRanks, check_same_batch, counted_once, data_ranks
from functrain.ensemble.stacked import run_step
from functrain.logging import History
from functrain.logging.writer import WriterBase, as_writer
from functrain.loop.data import as_loader, batch_device, data_key, noting_steps
from functrain.loop.data_resume import DataResume
from functrain.loop.evaluate import evaluate
from functrain.loop.events import Events, callback_names
from functrain.loop.options import FitOptions
from functrain.loop.state import FitResult, LoopState, RunFinishedWarning
from functrain.loop.window import Window
from functrain.step import as_step

if TYPE_CHECKING:
    from functrain.callbacks.progress import ProgressBar
    from functrain.step import Step

__all__ = ["Phase", "Progress", "Run", "Services"]


class Phase(enum.Enum):
    """Where a ``fit`` call stands: training, stopping after this step, or idle (the run had ended before
    this call: a :class:`RunFinishedWarning` said why, and no step is taken)."""

    TRAINING = "training"
    STOPPING = "stopping"
    IDLE = "idle"


@dataclasses.dataclass
class Progress:
    """Where the run stands: the one step count, the data position, this call's end and why it stops.

    ``step``: optimizer steps done (the callbacks' ``Context.step`` is a copy, set with it); ``position``:
    where the data stream stands after them; ``arriving``: where it will stand once the batch in hand is
    trained on; ``total``: the step this call ends at; ``num_epochs``: the epochs the data is read up to
    (``None``: counted in steps); ``finished``: why the run ended for good (a final stop request: saved, so a
    resume stays finished), ``None`` while it may go on; ``stop_reason``: why this call stopped early;
    ``last_saved``: the step saved last in this call (``None``: none yet).
    """

    step: int
    position: DataPosition
    total: int
    num_epochs: int | None
    batches_per_epoch: int | None
    phase: Phase = Phase.TRAINING
    finished: str | None = None
    stop_reason: str = ""
    last_saved: int | None = None
    arriving: DataPosition = dataclasses.field(default_factory=DataPosition)


@dataclasses.dataclass
class Services:
    """What a run talks to besides the step: the training data (and its part of a checkpoint), the
    callbacks (by their checkpoint names; ``bar``: the progress bar ``fit`` added), the writers, the
    checkpoint manager (``None``: no checkpoints), and which slice of the data this process reads
    (``ranks``: a tensor-parallel group's ranks read one)."""

    data: DataResume
    callbacks: list[Callback]
    names: list[str]
    events: Events
    loggers: list[WriterBase]
    manager: Any
    bar: ProgressBar | None
    ranks: DataRanks

    @property
    def loader(self) -> Loader:
        """The training data (after a resume, ordered by the checkpoint's key)."""
        return self.data.loader

    @classmethod
    def open(
        cls, state: Any, train_step: Callable[..., Any], train_data: Any, options: FitOptions
    ) -> Services:
        """Open the training data and check it and the step against ``state``; every refusal comes before
        the first step."""
        from functrain.callbacks.progress import ProgressBar

        ranks = data_ranks(state)  # tensor parallelism: a slice per tp group, the same on its ranks
        loader = as_loader(
            train_data,
            options.batch_size,
            data_key(state),
            "fit",
            shuffle=True,
            shard=True,
            ranks=(ranks.rank, ranks.world_size),
            device=batch_device(state),
        )
        loader.require_batches("fit")  # before any step: zero steps is never a finished run
        as_step(train_step).check(state, "fit")
        if options.length.counts_epochs and loader.batches_per_epoch is None:
            raise ValueError(
                "fit: the training data has no length, so epochs cannot be counted; use max_steps "
                "(or additional_steps)"
            )
        callbacks = list(options.callbacks)
        manager = _as_manager(options.checkpoints, callbacks)
        main = distributed.is_main_process()  # only rank 0 shows progress and writes logs
        bar = None
        if options.progress_bar and main and not any(isinstance(cb, ProgressBar) for cb in callbacks):
            bar = ProgressBar()
            callbacks.append(bar)
        loggers = [as_writer(lg) for lg in options.loggers] if main else []
        return cls(
            DataResume(loader), callbacks, callback_names(callbacks), Events(callbacks), loggers, manager, bar,
            ranks,
        )  # fmt: skip


@dataclasses.dataclass
class Run:
    """One ``fit`` call's host side, made ready by :meth:`start`; then per batch ``before_step``/
    ``after_step`` (the due work in them), ``close`` and ``finish``."""

    train_step: Callable[..., Any]
    spec: Step
    options: FitOptions
    services: Services
    progress: Progress
    history: History
    window: Window
    ctx: Context
    restored_path: str | None  # the checkpoint this call resumed from
    compiled: tuple[Any, ...]  # the compiled steps (train, eval): Context.compiles counts their graphs
    tiers: TieredStep | None  # a tiered train step: asked for its tier at each step boundary
    _batches: Generator[Any, None, None] | None = None
    _unchecked: bool = True  # the first batch of the call is compared over a tp group (check_same_batch)

    # ------------------------------------------------------------------------------ start: open and resume

    @classmethod
    def start(
        cls, state: Any, train_step: Callable[..., Any], train_data: Any, options: FitOptions
    ) -> tuple[Run, Any]:
        """The run, ready, and the state to train from: the arguments checked and the data opened, the state
        (with the loop's own) restored from a checkpoint when ``options.resume`` says so and there is one,
        this call's length resolved, ``train_begin`` fired (and ``checkpoint_restored`` after a resume).

        Example:
            >>> import torch, functrain as ft
            >>> from functrain.loop import RunLength
            >>> model = torch.nn.Linear(4, 2)
            >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
            >>> train_step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
            >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(16)]
            >>> options = FitOptions(RunLength(epochs=1), batch_size=8, progress_bar=False)
            >>> run, state = Run.start(state, train_step, data, options)
            >>> run.progress.step, run.progress.phase
            (0, <Phase.TRAINING: 'training'>)
            >>> run.close()
        """
        services = Services.open(state, train_step, train_data, options)
        spec = as_step(train_step)
        naming = spec.naming(state)
        history = options.history if options.history is not None else History()
        window, position, finished = Window(naming), DataPosition(), None
        found = _checkpoint(options.resume, services.manager)
        restored_path = found[0] if found is not None else None
        if found is not None:
            state, saved = restore_onto(state, found[1]["state"]), found[1]["loop"]
            position = DataPosition(saved["position"]["epoch"], saved["position"]["index"])
            for n, cb in zip(services.names, services.callbacks):
                if n in saved["callbacks"]:
                    cb.load_state_dict(saved["callbacks"][n])
            history = History.from_dict(json.loads(saved["history"]))
            window = Window.from_json(saved["window"], state.params, naming)
            finished = str(saved.get("finished", "")) or None
            services.data.restore(saved, position)
        tiers = train_step if isinstance(train_step, TieredStep) else None
        if tiers is not None:
            if found is not None:  # the interrupted run's decision, replayed (none yet: decided again)
                tiers.restore(TierPlan.from_json(str(found[1]["loop"].get("tiers", ""))))
            if isinstance(options.eval_step, TieredStep):
                options.eval_step.follow(tiers)
        progress = _progress(state, services, options, position, finished, restored_path is not None)
        ctx = Context(
            step=progress.step,
            max_steps=progress.total,
            batches_per_epoch=progress.batches_per_epoch,
            log_steps=options.log_steps,
            history=history,
        )
        jit = sys.modules.get("functrain.jit")  # loaded wherever a step is a CompiledStep
        kind = (TieredStep, jit.CompiledStep) if jit is not None else TieredStep
        compiled = tuple(s for s in (train_step, options.eval_step) if isinstance(s, kind))
        run = cls(
            train_step,
            spec,
            options,
            services,
            progress,
            history,
            window,
            ctx,
            restored_path,
            compiled,
            tiers,
        )
        return run, run._begin(state)

    def _begin(self, state: Any) -> Any:
        """Say what this call resumes (and check it may), then fire ``train_begin`` (and
        ``checkpoint_restored``)."""
        step, path = self.progress.step, self.restored_path
        if path is not None:
            from functrain.checkpoint.file import read_header

            layout = distributed.loader_layout(self.services.loader)
            distributed.check_resume(read_header(path).metadata, layout)
            if distributed.is_main_process():
                print(f"resumed from step {step} ({path})", file=sys.stderr, flush=True)
        for lg in self.services.loggers:
            lg.resume_from(step if path is not None else None)
        self.ctx.compiles = self.compiles()  # steps compiled by an earlier fit count as compiled already
        self.ctx.tier, self.ctx.compiling = self._tier()  # for train_begin (a bar's first words)
        state = self.services.events("train_begin", state, self.ctx)
        if path is not None:
            self.ctx.checkpoint_path = path
            state = self.services.events("checkpoint_restored", state, self.ctx)
        if path is not None or self.progress.phase is Phase.IDLE:
            self.progress.last_saved = step
        return state

    # ------------------------------------------------------------------------------ the steps

    @property
    def stopping(self) -> bool:
        """Whether the loop ends after the step just taken."""
        return self.progress.phase is not Phase.TRAINING

    @property
    def donated(self) -> bool:
        """Whether the train step donates its input state (then no callback may keep it)."""
        return bool(self.compiled) and self.compiled[0] is self.train_step and self.train_step.donate

    def compiles(self) -> int:
        return sum(step.num_compiles for step in self.compiled)

    def batches(self) -> Iterator[Any]:
        """This call's training batches, from where the data stream stands (none when there is nothing to
        do); the loop's position advances with each step."""
        progress = self.progress
        if progress.phase is Phase.IDLE:
            return iter(())
        start, check = self.services.data.start(progress.position)  # a replayed stream: one batch early
        stream = self.services.loader.iterate(start, num_epochs=progress.num_epochs)
        self._batches = self._arriving(noting_steps(stream, lambda: progress.step + 1), check)
        return self._batches

    def _arriving(self, stream: Generator[Any, None, None], check: str) -> Generator[Any, None, None]:
        try:
            for position, batch in stream:
                if check:
                    self.services.loader.check_replay(batch, check, *self.progress.position.as_tuple())
                    check = ""
                    continue
                self.progress.arriving = position
                yield batch
        finally:
            stream.close()  # now, not when the generator is collected: it stops the prefetch thread

    def before_step(self, state: Any, batch: Any) -> Any:
        """``epoch_begin`` at an epoch's first batch, then ``step_begin``."""
        ctx, events = self.ctx, self.services.events
        epoch, index = self.progress.arriving.as_tuple()
        ctx.epoch, ctx.batch_index = epoch, index - 1
        if index == 1:
            state = events("epoch_begin", state, ctx)
        ctx.batch = batch
        self.services.data.saw(batch)
        if self.options.check_batches == "every" or self._unchecked:  # tensor parallelism: one batch a group
            check_same_batch(batch, self.services.ranks, self.progress.step + 1)
            self._unchecked = False
        ctx.tier, ctx.compiling = self._tier()
        state = events("step_begin", state, ctx)
        ctx.previous_state = None if self.donated else state
        return state

    def _tier(self) -> tuple[str, bool]:
        """What takes the next step (a tiered step decides here, at the boundary) and whether it compiles."""
        step = self.train_step
        if self.tiers is not None:
            tier = self.tiers.at_step(self.progress.step, self.progress.total)
            return tier, self.tiers.compiling
        if self.compiled and self.compiled[0] is step:
            return ("inductor", step.num_compiles == 0) if step.compile else ("eager", False)
        return "", False

    def after_step(self, state: Any, metrics: Any) -> Any:
        """Count the step, fire ``step_end``, then log, end the epoch, evaluate and save when due."""
        ctx, progress, options = self.ctx, self.progress, self.options
        progress.step += 1
        progress.position = progress.arriving
        step, index = progress.step, int(progress.position.index)
        ctx.step, ctx.batch_index, ctx.metrics = step, index, metrics
        ctx.compiles = self.compiles()
        self.window.add(metrics)
        epoch_done = progress.batches_per_epoch is not None and index == progress.batches_per_epoch
        ctx.logging_step = step % options.log_steps == 0 or epoch_done or step >= progress.total
        state = self.services.events("step_end", state, ctx)
        ctx.previous_state = None
        control = ctx.control
        if control.should_log or ctx.logging_step:
            state = self.log(state)
        if epoch_done:
            state = self.services.events("epoch_end", state, ctx)
        if options.eval_step is not None and (options.evals.due(step, epoch_done) or control.should_evaluate):
            state = self.evaluate(state)
        if control.should_stop:
            progress.phase, progress.stop_reason = Phase.STOPPING, control.stop_reason
            if control.stop_is_final:
                progress.finished = (
                    control.stop_reason or "a callback stopped the run"
                )  # saved: stays finished
        if options.saves.due(step, epoch_done) or control.should_save:
            state = self.save(state)
        ctx.control = type(control)()
        ctx.batch = None
        if step >= progress.total:
            progress.phase = Phase.STOPPING
        return state

    # ------------------------------------------------------------------------------ the periodic work

    def log(self, state: Any) -> Any:
        """Log the window's averages and the train metrics (one sync), then reset the train metrics."""
        step, naming = self.progress.step, self.window.naming
        scalars = self.window.flush()
        train_metrics = self.spec.metrics
        if train_metrics is not None and state.metrics is not None:
            once = counted_once(train_metrics, state.metrics, self.services.ranks)  # a tp group counts once
            merged = distributed.all_reduce_metric_state(train_metrics, once)
            scalars.update(naming.flatten("train", train_metrics.compute(merged)))
        self.history.put_scalars(naming.expand(scalars), step)
        floats = self.history.at(step)  # ours and what callbacks put, with one sync for all
        self.ctx.logs.update(floats)
        for lg in self.services.loggers:
            lg.write(step, floats)
        if train_metrics is None or state.metrics is None:
            return state
        return state.replace(metrics=train_metrics.empty(state.device))

    def evaluate(self, state: Any) -> Any:
        """Evaluate, log the results and fire ``eval_begin``/``eval_end``."""
        ctx, options, step = self.ctx, self.options, self.progress.step
        state = self.services.events("eval_begin", state, ctx)
        assert options.eval_step is not None
        results = evaluate(
            state,
            options.eval_step,
            options.eval_data,
            batch_size=options.eval_batch_size or options.batch_size,
            callbacks=self.services.callbacks,
            ctx=ctx,
        )
        ctx.eval_metrics = results
        for k, v in results.items():
            self.history.put(k, v, step)
        ctx.logs.update(results)
        for lg in self.services.loggers:
            lg.write(step, results)
        return self.services.events("eval_end", state, ctx)

    def save(self, state: Any) -> Any:
        """Save the state with the loop's own (a checkpoint to resume from), when there is a manager."""
        services, progress = self.services, self.progress
        progress.last_saved = progress.step
        if services.manager is None:
            return state
        loop = LoopState(
            position=progress.position,
            callbacks={n: cb.state_dict() for n, cb in zip(services.names, services.callbacks)},
            history=json.dumps(self.history.as_dict()),
            window=self.window.to_json(),
            finished=progress.finished or "",
            tiers=self.tiers.plan.to_json() if self.tiers is not None else "",
            **services.data.fields(progress.position),
        )
        tied = getattr(state, "tied", ())
        metadata = {"tied_parameters": dict(tied)} if tied else {}
        services.manager.save(
            progress.step,
            {"state": state, "loop": loop},
            metrics=dict(self.ctx.eval_metrics or {}),
            metadata={**metadata, **distributed.loader_layout(services.loader)},
        )
        self.ctx.checkpoint_path = services.manager.path(progress.step)
        return services.events("checkpoint_saved", state, self.ctx)

    # ------------------------------------------------------------------------------ the end

    def save_last(self, state: Any) -> Any:
        """Save the final state unless it was just saved."""
        if self.services.manager is None or self.progress.last_saved == self.progress.step:
            return state
        return self.save(state)

    def close(self) -> None:
        """Stop the prefetch thread now, flush the writers, wait for asynchronous saves."""
        if self._batches is not None:
            self._batches.close()
        for lg in self.services.loggers:
            lg.flush()
        manager = self.services.manager
        if manager is not None and hasattr(manager, "wait_until_finished"):
            manager.wait_until_finished()

    def finish(self, state: Any) -> FitResult:
        """Fire ``train_end``; the :class:`FitResult`."""
        state = self.services.events("train_end", state, self.ctx)
        return FitResult(
            state=state,
            history=self.history,
            eval_metrics=self.ctx.eval_metrics,
            stop_reason=self.progress.stop_reason,
        )


def _checkpoint(resume: bool | int | str, manager: Any) -> tuple[str, Any] | None:
    """The checkpoint ``resume`` names, read: ``(its path, its contents)``; ``None``: start fresh."""
    resume_file = isinstance(resume, str | os.PathLike) and os.path.isfile(resume)
    if resume is False:
        return None
    if manager is None and not resume_file:
        raise ValueError("fit: resume needs checkpoints=CheckpointManager(...) (or a directory)")
    if resume_file:
        from functrain.checkpoint import restore

        return os.fspath(resume), restore(resume)
    if manager.latest() is None:
        return None
    which = "latest" if resume is True else resume
    raw = manager.restore(which)
    step = manager.latest() if which == "latest" else manager.best() if which == "best" else which
    return manager.path(step), raw


def _progress(
    state: Any,
    services: Services,
    options: FitOptions,
    position: DataPosition,
    finished: str | None,
    resumed: bool,
) -> Progress:
    """Where a run starts: its step, this call's length resolved, idle (and why: a warning) when there is
    nothing to do."""
    step, bpe, length = run_step(state), services.loader.batches_per_epoch, options.length
    if not resumed and step > 0 and bpe is not None:
        position = DataPosition.from_batch_count(step, bpe)  # continue the stream
    num_epochs, total = length.resolve(bpe, step, position)
    progress = Progress(step, position, total, num_epochs, bpe, finished=finished)
    idle = length.nothing_to_do(finished or "", step, total, bpe)
    if idle:
        warnings.warn(idle, RunFinishedWarning, stacklevel=4)  # at fit's caller
        services.events = Events([cb for cb in services.callbacks if cb is not services.bar])
        progress.phase, progress.stop_reason = Phase.IDLE, finished or ""
    elif length.extending:
        progress.finished = None
    return progress


def _as_manager(checkpoints: Any, callbacks: list[Callback]) -> Any:
    """A CheckpointManager from ``checkpoints`` (one, or a directory), else a ModelCheckpoint's."""
    if isinstance(checkpoints, str | os.PathLike):
        from functrain.checkpoint import CheckpointManager

        return CheckpointManager(checkpoints)
    if checkpoints is not None:
        return checkpoints
    from functrain.callbacks.checkpointing import ModelCheckpoint

    return next((cb.manager for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
