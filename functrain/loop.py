"""The loop: ``fit``, ``evaluate`` and ``predict`` — thin host code around pure, compiled steps.

``fit`` folds ``train_step`` over the batches, fires callbacks between steps, evaluates, logs and saves
checkpoints when due, and resumes exactly: the data position, the callbacks' states and the history are
saved with the train state, so a run stopped at any step and restarted from its checkpoint ends
bit-identical to an uninterrupted one.

The host reads device values only on logging steps (one sync for all scalars) and at evaluations.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
    >>> result = ft.fit(state, ft.jit(ft.make_train_step(model, loss_fn), compile=False), data,
    ...                 batch_size=16, epochs=2, progress_bar=False)
    >>> int(result.state.step)
    8
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from functrain import distributed, random, tree
from functrain.callbacks.base import Callback, Context
from functrain.data import DataPosition, Loader
from functrain.data.notes import add_note
from functrain.ensemble.stacked import is_ensemble, run_key, run_step, size
from functrain.logging import History
from functrain.logging.members import expand_members

__all__ = ["FitResult", "LoopState", "RunFinishedWarning", "evaluate", "fit", "predict"]

_DATA_KEY = 0xDA7A


def data_key(state: Any) -> torch.Tensor:
    """The key that orders a run's training data (shuffling): one function of the run's key, shared by
    ``fit`` and the Trainer so that both feed a run the same batches."""
    return random.fold_in(run_key(state), _DATA_KEY)


@tree.struct
class LoopState:
    """What the loop must remember across a resume, saved beside the train state in each checkpoint.

    ``position``: where the data stream stands; ``callbacks``: each callback's ``state_dict()`` by name;
    ``history``: the logged scalars (JSON); ``window``: the running sums of the current logging window
    (JSON), so a resumed run logs the same averages; ``finished``: why the run ended for good (a final
    stop request such as early stopping), ``""`` while it may go on.
    """

    position: DataPosition
    callbacks: dict[str, Any]
    history: str
    window: str
    finished: str = ""


class RunFinishedWarning(UserWarning):
    """``fit`` had nothing to do: the run already ended (its length reached, or stopped for good)."""


@dataclasses.dataclass
class FitResult:
    """What ``fit`` returns.

    Attributes:
        state: the final train state.
        history: every logged scalar (``history.series("eval/loss")``...).
        eval_metrics: the last evaluation's results, or ``None``.
        stop_reason: why the run ended early (a callback's reason, ``"preempted by SIGTERM"``...), or ``""``.
    """

    state: Any
    history: History
    eval_metrics: dict[str, float] | None = None
    stop_reason: str = ""

    @property
    def preempted(self) -> bool:
        """True when a signal ended the run (resume it with ``resume=True``)."""
        return self.stop_reason.startswith("preempted")


# ------------------------------------------------------------------------------------------ helpers


def _batch_device(state: Any) -> torch.device | None:
    """Where the step wants its batches: the state's accelerator, or ``None`` (leave them as they are)."""
    device = getattr(state, "device", None)
    return device if isinstance(device, torch.device) and device.type != "cpu" else None


def _as_loader(
    data: Any,
    batch_size: int | None,
    key: torch.Tensor,
    what: str,
    *,
    shuffle: bool,
    shard: bool = False,
    device: torch.device | None = None,
) -> Loader:
    """A Loader over ``data`` whose batches arrive on ``device`` (a Loader with a device of its own keeps it).

    On CUDA the host batches are pinned and copied without blocking, ahead of the step, by the Loader's
    prefetch thread.
    """
    if isinstance(data, Loader):
        return data.to(device) if device is not None and data.device is None else data
    if batch_size is None and not isinstance(data, torch.utils.data.DataLoader):
        raise ValueError(
            f"{what}: give a functrain.data.Loader, a torch DataLoader, or a dataset together with "
            "batch_size=..."
        )
    if isinstance(data, torch.utils.data.DataLoader):
        return Loader(data, device=device)
    pin = device is not None and device.type == "cuda"
    if isinstance(data, torch.utils.data.IterableDataset):
        return Loader(data, batch_size, pin_memory=pin, device=device)
    # Data parallelism: each rank reads its slice of the same per-epoch permutation; batch_size is per rank.
    ranks = {"rank": distributed.rank(), "world_size": distributed.world_size()} if shard else {}
    return Loader(data, batch_size, key=key, shuffle=shuffle, pin_memory=pin, device=device, **ranks)


def _scalar_dict(values: Mapping[str, Any]) -> dict[str, float]:
    """Tensors -> floats with a single device sync."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    if names:
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in names]).cpu().tolist()
        out.update(zip(names, stacked))
    return out


def _flatten_metric_values(prefix: str, computed: Any, members: int | None = None) -> dict[str, Any]:
    """Nested metric dicts -> ``prefix/name`` keys; a vector metric (per class) -> ``name_0``, ``name_1``...
    With ``members`` (an ensemble), every value carries a leading member axis that is kept, for
    :func:`~functrain.logging.expand_members`."""
    out: dict[str, Any] = {}
    if isinstance(computed, Mapping):
        for name, value in computed.items():
            out.update(_flatten_metric_values(f"{prefix}/{name}" if prefix else str(name), value, members))
    elif isinstance(computed, torch.Tensor) and computed.numel() > (members or 1):
        flat = computed.reshape(members, -1) if members else computed.reshape(-1)
        for i in range(flat.shape[-1]):
            out[f"{prefix}_{i}"] = flat[..., i]
    else:
        out[prefix] = computed
    return out


class _Events:
    """Fires one event on every callback, threading the state through and checking what comes back."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, event: str, state: Any, ctx: Context) -> Any:
        for cb in self.callbacks:
            new = getattr(cb, f"on_{event}")(state, ctx)
            if type(new) is not type(state):
                raise TypeError(
                    f"callback {type(cb).__name__}.on_{event} returned {type(new).__name__}; a callback must "
                    f"return the state ({type(state).__name__}), unchanged or new"
                )
            state = new
        return state


def _callback_names(callbacks: Sequence[Callback]) -> list[str]:
    names: list[str] = []
    for cb in callbacks:
        base = cb.name or type(cb).__name__
        name, i = base, 1
        while name in names:
            i += 1
            name = f"{base}_{i}"
        names.append(name)
    return names


# ------------------------------------------------------------------------------------------ evaluate


def evaluate(
    state: Any,
    eval_step: Callable[[Any, Any], Mapping[str, Any]],
    data: Any,
    *,
    batch_size: int | None = None,
    callbacks: Sequence[Callback] = (),
    ctx: Context | None = None,
    prefix: str = "eval",
) -> dict[str, float]:
    """Run ``eval_step`` over ``data`` and return example-weighted metrics over the whole set.

    The loss is weighted by each batch's example count (a short last batch counts for what it holds);
    metric states are merged across batches and computed once, so accuracy, F1 and the rest equal the
    metric over the whole set. One host sync at the end.

    Example:
        >>> metrics = ft.evaluate(state, ft.jit(ft.make_eval_step(model, loss_fn)), eval_data, batch_size=64)
        >>> sorted(metrics)
        ['eval/loss']
    """
    loader = _as_loader(
        data, batch_size, random.key(0), "evaluate", shuffle=False, shard=True, device=_batch_device(state)
    )
    events = _Events(callbacks)
    ctx = ctx or Context()
    ctx.phase = "eval"
    metric_fns = getattr(eval_step, "metrics", None)
    loss_sum: torch.Tensor | None = None
    count = 0
    merged = None
    extra_sums: dict[str, torch.Tensor] = {}
    for batch in loader.epoch(0):
        ctx.batch = batch
        state = events("eval_batch_begin", state, ctx)
        out = eval_step(state, batch)
        n = int(out["num_examples"])
        if n == 0:
            continue  # an empty shard of a distributed last batch
        weighted = out["loss"] * n
        loss_sum = weighted if loss_sum is None else loss_sum + weighted
        count += n
        for k, v in out.items():
            if k not in ("loss", "num_examples", "metrics", "preds") and isinstance(v, torch.Tensor):
                extra_sums[k] = extra_sums.get(k, 0) + v * n
        if out.get("metrics") is not None and metric_fns is not None:
            merged = out["metrics"] if merged is None else metric_fns.merge(merged, out["metrics"])
        state = events("eval_batch_end", state, ctx)
    ctx.batch = None
    ctx.phase = "train"
    loss_sum, count, extra_sums, merged = distributed.merge_evaluation(
        loss_sum, count, extra_sums, merged, metric_fns, state.device
    )
    if count == 0:
        raise ValueError("evaluate: the evaluation data produced no examples")
    members = _members(state)
    values: dict[str, Any] = {f"{prefix}/loss": loss_sum / count}
    values.update({f"{prefix}/{k}": v / count for k, v in extra_sums.items()})
    if merged is not None:
        values.update(_flatten_metric_values(prefix, metric_fns.compute(merged), members))
    return _scalar_dict(expand_members(values, members))


# ------------------------------------------------------------------------------------------ predict


def predict(
    state: Any,
    predict_step: Callable[[Any, Any], Any],
    data: Any,
    *,
    batch_size: int | None = None,
    collect: bool = False,
) -> Iterator[Any] | Any:
    """Stream ``predict_step`` outputs batch by batch (``collect=True``: concatenate them all).

    Example:
        >>> outputs = ft.predict(state, ft.make_predict_step(model), inputs, batch_size=32, collect=True)
    """
    loader = _as_loader(
        data, batch_size, random.key(0), "predict", shuffle=False, device=_batch_device(state)
    )

    def stream() -> Iterator[Any]:
        for batch in loader.epoch(0):
            yield predict_step(state, batch)

    if not collect:
        return stream()
    outputs = list(stream())
    if not outputs:
        return outputs
    return tree.map(lambda *xs: torch.cat(xs) if isinstance(xs[0], torch.Tensor) else list(xs), *outputs)


# ------------------------------------------------------------------------------------------ fit


def _resolve_every(value: int | str | None, name: str) -> tuple[int | None, bool]:
    """``(every_n_steps, at_epoch_end)`` from ``int`` steps, ``"epoch"`` or ``None``."""
    if value is None or value == "no":
        return None, False
    if value == "epoch":
        return None, True
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, False
    raise ValueError(f"fit: {name} must be a positive number of steps, 'epoch' or None, got {value!r}")


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
    log_every: int = 50,
    callbacks: Iterable[Callback] = (),
    loggers: Iterable[Any] = (),
    checkpoints: Any = None,
    save_every: int | str | None = None,
    resume: bool | int | str = False,
    progress_bar: bool = True,
    history: History | None = None,
    progress: bool | None = None,
) -> FitResult:
    """Train: fold ``train_step`` over ``train_data`` for ``epochs`` or ``max_steps`` optimizer steps.

    Args:
        state: the initial train state (ignored in favour of the checkpoint when resuming).
        train_step: ``(state, batch) -> (state, metrics)``, usually ``jit(make_train_step(...))``.
        train_data: a :class:`functrain.data.Loader`, a torch ``DataLoader``, or a dataset with
            ``batch_size`` (shuffled per epoch with a key derived from ``state.rng``). Batches are moved
            to the state's device (on CUDA: pinned, copied ahead of the step); a ``Loader`` given its own
            ``device`` keeps it.
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
        log_every: log (and sync the host) every this many steps; also at epoch ends.
        callbacks: :class:`functrain.callbacks.Callback` objects for this run.
        loggers: writers with ``write(step, scalars)`` (``functrain.logging``: console, JSONL, CSV,
            TensorBoard).
        checkpoints: a :class:`functrain.checkpoint.CheckpointManager` (or a directory for one).
        save_every: a number of steps, ``"epoch"`` or ``None``; the final state is saved too.
        resume: ``True`` resumes from the latest checkpoint if there is one (else starts fresh), a step
            number or ``"best"`` from that checkpoint, a path from that checkpoint file; ``False`` starts
            fresh. A resumed run that had ended (its length reached, early stopping or another final stop
            request) returns its final state at once, trains and logs nothing, and warns why
            (:class:`RunFinishedWarning`). Without resume, a state that has already taken steps continues
            the data stream where its step count puts it.
        progress_bar: show a progress bar (``tqdm.auto``: terminal and notebook), as
            ``TrainerConfig.progress_bar``.
        progress: deprecated alias of ``progress_bar`` (a ``DeprecationWarning``; removed in the next
            release).

    Returns:
        :class:`FitResult` with the final state, the history and the last evaluation.

    Example:
        >>> result = ft.fit(state, train_step, train_set, batch_size=32, epochs=3,
        ...                 eval_step=eval_step, eval_data=val_set, checkpoints="runs/ckpt", resume=True)
    """
    from functrain.callbacks.progress import ProgressBar

    if progress is not None:
        warnings.warn(
            "fit(progress=...) is deprecated: use progress_bar=..., the name TrainerConfig and the CLI use",
            DeprecationWarning,
            stacklevel=2,
        )
        progress_bar = progress
    extending = additional_epochs is not None or additional_steps is not None
    if not extending and epochs is None and max_steps is None:
        raise ValueError("fit: give epochs=... or max_steps=... (how long to train)")
    if extending and (
        epochs is not None or max_steps is not None or None not in (additional_epochs, additional_steps)
    ):
        raise ValueError(
            "fit: give one of epochs/max_steps (the run's total length) or one of additional_epochs/"
            "additional_steps (more, from where the state stands), not several"
        )
    for name, value in (
        ("epochs", epochs),
        ("max_steps", max_steps),
        ("additional_epochs", additional_epochs),
        ("additional_steps", additional_steps),
        ("log_every", log_every),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"fit: {name} must be a positive int, got {value!r}")
    if (eval_step is None) != (eval_data is None):
        raise ValueError("fit: eval_step and eval_data go together (give both or neither)")
    eval_steps_every, eval_at_epoch = _resolve_every(
        eval_every if eval_step is not None else None, "eval_every"
    )
    save_steps_every, save_at_epoch = _resolve_every(save_every, "save_every")

    loader = _as_loader(
        train_data,
        batch_size,
        data_key(state),
        "fit",
        shuffle=True,
        shard=True,
        device=_batch_device(state),
    )
    loader.require_batches("fit")  # before any step: zero steps is never a finished run
    if distributed.is_distributed() and getattr(train_step, "kind", None) == "train":
        reducer = getattr(train_step, "gradient_reducer", None)
        if reducer is None or getattr(reducer, "world_size", 0) != distributed.world_size():
            raise ValueError(
                f"fit: {distributed.world_size()} processes train, but the train step does not all-reduce "
                "its gradients over them, so the ranks would drift apart; build it with make_train_step(..., "
                "gradient_reducer=functrain.distributed.gradient_reducer(model=model)), created after "
                "functrain.distributed.initialize()"
            )
    if (
        is_ensemble(state)
        and getattr(train_step, "kind", None) == "train"
        and not getattr(train_step, "ensemble", False)
    ):
        raise ValueError(
            f"fit: the state is an ensemble of {size(state)} members, but the train step runs one model; "
            "wrap it: ft.jit(ft.ensemble.step(train_step)) (and ft.ensemble.eval_step for evaluation)"
        )
    bpe = loader.batches_per_epoch
    if (epochs is not None or additional_epochs is not None) and bpe is None:
        raise ValueError(
            "fit: the training data has no length, so epochs cannot be counted; use max_steps "
            "(or additional_steps)"
        )

    callbacks = list(callbacks)
    manager = _as_manager(checkpoints)
    if manager is None:
        from functrain.callbacks.checkpointing import ModelCheckpoint

        manager = next((cb.manager for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
    main = distributed.is_main_process()  # only rank 0 shows progress and writes logs
    auto_bar = None
    if progress_bar and main and not any(isinstance(cb, ProgressBar) for cb in callbacks):
        auto_bar = ProgressBar()
        callbacks.append(auto_bar)
    names = _callback_names(callbacks)
    events = _Events(callbacks)
    loggers = list(loggers) if main else []
    history = history if history is not None else History()
    members = _members(state)
    window = _Window(members)
    position = DataPosition()
    ctx = Context(batches_per_epoch=bpe, log_every=log_every, history=history)
    finished = ""  # why the run ended for good: recorded in its checkpoints

    def loop_state() -> LoopState:
        return LoopState(
            position=position,
            callbacks={n: cb.state_dict() for n, cb in zip(names, callbacks)},
            history=json.dumps(history.as_dict()),
            window=window.to_json(),
            finished=finished,
        )

    # ---- resume
    restored_path = None
    resume_file = isinstance(resume, str | os.PathLike) and os.path.isfile(resume)
    if resume is not False and (manager is not None or resume_file):
        which = "latest" if resume is True else resume
        if resume_file or manager.latest() is not None:
            from functrain.checkpoint import restore

            raw = restore(resume) if resume_file else manager.restore(which)
            state = _onto(state, raw["state"])
            saved = raw["loop"]
            position = DataPosition(saved["position"]["epoch"], saved["position"]["index"])
            for n, cb in zip(names, callbacks):
                if n in saved["callbacks"]:
                    cb.load_state_dict(saved["callbacks"][n])
            history = History.from_dict(json.loads(saved["history"]))
            ctx.history = history
            window = _Window.from_json(saved["window"], state.params, members)
            finished = str(saved.get("finished", ""))
            if resume_file:
                restored_path = os.fspath(resume)
            else:
                restored_path = manager.path(
                    manager.latest() if which == "latest" else manager.best() if which == "best" else which
                )
    elif resume is not False and manager is None:
        raise ValueError("fit: resume needs checkpoints=CheckpointManager(...) (or a directory)")

    host_step = run_step(state)
    if restored_path is None and host_step > 0 and bpe is not None:
        position = DataPosition.from_batch_count(host_step, bpe)  # continue the stream, as a resume would
    num_epochs, total = _run_length(
        epochs, max_steps, additional_epochs, additional_steps, bpe, host_step, position
    )
    ctx.step, ctx.max_steps = host_step, total
    nothing_to_do = _nothing_to_do(finished, extending, host_step, total, epochs, max_steps, bpe)
    if nothing_to_do:
        warnings.warn(nothing_to_do, RunFinishedWarning, stacklevel=2)
        events = _Events([cb for cb in callbacks if cb is not auto_bar])
    elif extending:
        finished = ""
    if restored_path is not None:
        from functrain.checkpoint.file import read_header

        distributed.check_resume(read_header(restored_path).metadata, distributed.loader_layout(loader))
    for lg in loggers:
        if hasattr(lg, "resume_from"):
            lg.resume_from(host_step if restored_path is not None else None)

    def do_log() -> None:
        scalars = window.flush()
        train_metrics = getattr(train_step, "metrics", None)
        if train_metrics is not None and state.metrics is not None:
            merged = distributed.all_reduce_metric_state(train_metrics, state.metrics)
            scalars.update(_flatten_metric_values("train", train_metrics.compute(merged), members))
        history.put_scalars(expand_members(scalars, members), host_step)
        floats = history.at(host_step)  # ours and what callbacks put, with one sync for all
        ctx.logs.update(floats)
        for lg in loggers:
            lg.write(host_step, floats)

    def reset_train_metrics(s: Any) -> Any:
        train_metrics = getattr(train_step, "metrics", None)
        if train_metrics is None or s.metrics is None:
            return s
        return s.replace(metrics=train_metrics.empty(s.device))

    def do_eval(s: Any) -> Any:
        s = events("eval_begin", s, ctx)
        results = evaluate(
            s, eval_step, eval_data, batch_size=eval_batch_size or batch_size, callbacks=callbacks, ctx=ctx
        )
        ctx.eval_metrics = results
        for k, v in results.items():
            history.put(k, v, host_step)
        ctx.logs.update(results)
        for lg in loggers:
            lg.write(host_step, results)
        return events("eval_end", s, ctx)

    def do_save(s: Any) -> Any:
        if manager is None:
            return s
        metrics = dict(ctx.eval_metrics or {})
        manager.save(
            host_step,
            {"state": s, "loop": loop_state()},
            metrics=metrics,
            metadata={**_metadata(s), **distributed.loader_layout(loader)},
        )
        ctx.checkpoint_path = manager.path(host_step)
        return events("checkpoint_saved", s, ctx)

    def compiles() -> int:
        return sum(getattr(fn, "num_compiles", 0) for fn in (train_step, eval_step))

    ctx.compiles = compiles()  # steps compiled by an earlier fit count as compiled already
    state = events("train_begin", state, ctx)
    if restored_path is not None:
        ctx.checkpoint_path = restored_path
        state = events("checkpoint_restored", state, ctx)

    stop_reason = finished if nothing_to_do else ""
    last_saved = host_step if restored_path is not None or nothing_to_do else -1
    epoch_started = None
    stream = None
    try:
        if not nothing_to_do:
            stream = _noting_steps(loader.iterate(position, num_epochs=num_epochs), lambda: host_step + 1)
            for next_position, batch in stream:
                epoch, index = next_position.as_tuple()
                ctx.epoch, ctx.batch_index = epoch, index - 1
                if index == 1 or epoch_started != epoch:
                    if index == 1:
                        state = events("epoch_begin", state, ctx)
                    epoch_started = epoch
                ctx.batch = batch
                state = events("step_begin", state, ctx)
                ctx.previous_state = None if getattr(train_step, "donate", False) else state
                state, metrics = train_step(state, batch)
                host_step += 1
                position = next_position
                ctx.step, ctx.batch_index, ctx.metrics = host_step, index, metrics
                ctx.compiles = compiles()
                window.add(metrics)
                epoch_done = bpe is not None and index == bpe
                ctx.logging_step = host_step % log_every == 0 or epoch_done or host_step >= total
                state = events("step_end", state, ctx)
                ctx.previous_state = None
                control = ctx.control
                if control.should_log or ctx.logging_step:
                    do_log()
                    state = reset_train_metrics(state)
                if epoch_done:
                    state = events("epoch_end", state, ctx)
                due_eval = (eval_steps_every and host_step % eval_steps_every == 0) or (
                    eval_at_epoch and epoch_done
                )
                if eval_step is not None and (due_eval or control.should_evaluate):
                    state = do_eval(state)
                stop = control.should_stop
                stop_reason = control.stop_reason if stop else ""
                if stop and control.stop_is_final:
                    finished = stop_reason or "a callback stopped the run"  # saved below: stays finished
                due_save = (save_steps_every and host_step % save_steps_every == 0) or (
                    save_at_epoch and epoch_done
                )
                if due_save or control.should_save:
                    state = do_save(state)
                    last_saved = host_step
                ctx.control = type(control)()
                ctx.batch = None
                if stop or host_step >= total:
                    break
        if manager is not None and last_saved != host_step:
            state = do_save(state)
    finally:
        if stream is not None:
            stream.close()  # stops the prefetch thread now, not when the generator is collected
        for lg in loggers:
            if hasattr(lg, "flush"):
                lg.flush()
        if manager is not None and hasattr(manager, "wait_until_finished"):
            manager.wait_until_finished()
    state = events("train_end", state, ctx)
    return FitResult(state=state, history=history, eval_metrics=ctx.eval_metrics, stop_reason=stop_reason)


def _noting_steps(stream: Iterator[Any], next_step: Callable[[], int]) -> Iterator[Any]:
    """``stream`` as it is, but an error raised while loading a batch leaves with a note naming the
    training step that batch was for (the Loader's own note names its epoch and batch)."""
    try:
        yield from stream
    except Exception as error:  # a generator sees only its source's errors, never the loop body's
        add_note(error, f"functrain.fit: loading the batch of training step {next_step()}")
        raise


def _run_length(
    epochs: int | None,
    max_steps: int | None,
    additional_epochs: int | None,
    additional_steps: int | None,
    bpe: int | None,
    host_step: int,
    position: DataPosition,
) -> tuple[int | None, int]:
    """``(epochs to iterate up to, total optimizer steps)`` of this call, counted from step 0."""
    if additional_steps is not None:
        return None, host_step + additional_steps
    if additional_epochs is not None:
        assert bpe is not None
        num_epochs = position.normalized(bpe).as_tuple()[0] + additional_epochs
        return num_epochs, num_epochs * bpe
    if epochs is None:
        assert max_steps is not None
        return None, max_steps
    assert bpe is not None
    return epochs, epochs * bpe if max_steps is None else min(max_steps, epochs * bpe)


def _nothing_to_do(
    finished: str,
    extending: bool,
    host_step: int,
    total: int,
    epochs: int | None,
    max_steps: int | None,
    bpe: int | None,
) -> str:
    """Why this ``fit`` call has nothing to train (the warning's text), or ``""``."""
    if finished and not extending:
        why = f"the run was stopped for good at step {host_step}: {finished}"
    elif host_step >= total:
        length = " and ".join(f"{k}={v}" for k, v in (("epochs", epochs), ("max_steps", max_steps)) if v)
        why = (
            f"the state is at step {host_step}, and {length or 'this length'} ends the run at step {total} "
            "(epochs and max_steps count the whole run from step 0, so that the same call resumes a run)"
        )
    else:
        return ""
    more = ""
    if not finished:
        more = f"epochs={host_step // bpe + 1}, " if epochs and bpe else f"max_steps={host_step}+N, "
    return (
        f"fit: nothing to do, returning the state as it is: {why}. To train more, pass "
        f"{more}additional_epochs=N or additional_steps=N (Trainer.train takes the same; the CLI: "
        "functrain train ... --additional-epochs N)"
    )


def _onto(target: Any, saved: Any, where: str = "state") -> Any:
    """Put a checkpoint's plain containers back into ``target``'s structure, checking every leaf.

    ``where`` names ``target`` in the errors (``"state.params"`` when restoring only the parameters).
    """
    problems: list[str] = []

    def pick(path: tuple, leaf: Any) -> Any:
        node = saved
        for key in path:
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                problems.append(f"missing in checkpoint: {where}.{tree.path_str(path)}")
                return leaf
        if isinstance(leaf, torch.Tensor):
            if not isinstance(node, torch.Tensor):
                problems.append(
                    f"{where}.{tree.path_str(path)}: checkpoint holds {type(node).__name__}, not a tensor"
                )
                return leaf
            if node.shape != leaf.shape or node.dtype != leaf.dtype:
                problems.append(
                    f"{where}.{tree.path_str(path)}: checkpoint {node.dtype} {list(node.shape)}, "
                    f"model {leaf.dtype} {list(leaf.shape)}"
                )
                return leaf
            return node.to(leaf.device)
        return node

    out = tree.map_with_path(pick, target)
    if problems:
        raise ValueError(
            "the checkpoint does not match this run's state (was it written for another model or "
            "optimizer?):\n  " + "\n  ".join(problems[:30])
        )
    return out


def _metadata(state: Any) -> dict[str, Any]:
    tied = getattr(state, "tied", ())
    return {"tied_parameters": dict(tied)} if tied else {}


def _as_manager(checkpoints: Any) -> Any:
    if checkpoints is None:
        return None
    if isinstance(checkpoints, str | os.PathLike):
        from functrain.checkpoint import CheckpointManager

        return CheckpointManager(checkpoints)
    return checkpoints


class _Window:
    """Running sums of the step metrics since the last log, kept on the device (no sync per step).
    An ensemble's metrics (``members`` given) are ``[members]`` vectors, summed the same way."""

    def __init__(self, members: int | None = None) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.members = members

    def add(self, metrics: Mapping[str, torch.Tensor]) -> None:
        shape = () if self.members is None else (self.members,)
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor) and v.shape == shape:
                v = v.detach().float()
                self.sums[k] = v if k not in self.sums else self.sums[k] + v
        self.count += 1

    def flush(self) -> dict[str, Any]:
        out = {f"train/{k}": v / self.count for k, v in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return out

    def to_json(self) -> str:
        def number(v: float) -> float | str:
            return v if math.isfinite(v) else repr(v)

        if self.members is None:
            sums: dict[str, Any] = {k: number(v) for k, v in _scalar_dict(self.sums).items()}
        else:
            sums = {k: [number(x) for x in v.detach().cpu().tolist()] for k, v in self.sums.items()}
        return json.dumps({"count": self.count, "sums": sums})

    @classmethod
    def from_json(cls, text: str, like: Mapping[str, torch.Tensor], members: int | None = None) -> _Window:
        data = json.loads(text)
        window = cls(members)
        window.count = int(data["count"])
        device = next(iter(like.values())).device if like else torch.device("cpu")

        def tensor(v: Any) -> torch.Tensor:
            value = [float(x) for x in v] if isinstance(v, list) else float(v)
            return torch.tensor(value, dtype=torch.float32, device=device)

        window.sums = {k: tensor(v) for k, v in data["sums"].items()}
        return window


def _members(state: Any) -> int | None:
    """The member count of an ensemble state (``functrain.ensemble``), ``None`` for one model."""
    return size(state) if is_ensemble(state) else None
