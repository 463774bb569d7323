"""`Trainer`: the facade over state, steps and loop, configured by a `TrainerConfig`.

What users of Towhee's, LiBai's, Hezar's and Kornia's trainers expect — configs by name and YAML,
callbacks, metrics, TensorBoard, early stopping, checkpoints, mixed precision, accumulation — built from
functrain's pure pieces (:mod:`functrain.trainer.build`): every config field is consumed (none is accepted
and ignored).

Extension points, as in the seed trainers, by subclassing: ``compute_loss(model, batch)``,
``preprocess(batch)`` and ``augment(batch)`` (run *inside* the compiled step), ``build_optimizer()``,
and ``train_step``/``eval_step`` themselves (pure functions of ``(state, batch)``; the default ones are
built by :func:`functrain.make_train_step`). The Trainer compiles the steps it built
(:class:`functrain.step.Step` values), so what :func:`functrain.jit` does for a model (the RNN rewrite,
Hugging Face's checkpoint routing, the attention fast path, the eager settling forward) applies. An
overridden ``train_step``/``eval_step`` runs as such a step too, with the built step's fields: the model
(so those paths apply to the model it calls), the metrics, and the settling forward (training: the
Trainer's own ``compute_loss`` forward, not the override's; evaluation: the override, once, eagerly);
its batches come unpadded.

Example:
    >>> import tempfile, torch, functrain as ft
    >>> run_dir = tempfile.TemporaryDirectory()
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    >>> data = [(torch.randn(1, 4, 4), torch.tensor(i % 3)) for i in range(48)]
    >>> config = ft.TrainerConfig(output_dir=run_dir.name, epochs=2, batch_size=8, metrics=["accuracy"],
    ...                           compile=False, progress_bar=False, print_summary=False)
    >>> trainer = ft.Trainer(model, config, train_dataset=data[:32], eval_dataset=data[32:40])
    >>> int(trainer.train().state.step)  # 2 epochs of 4 batches
    8
    >>> sorted(trainer.evaluate(data[40:]))
    ['eval/accuracy', 'eval/loss']
    >>> run_dir.cleanup()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from functrain import callbacks as cbs
from functrain import checkpoint, distributed, ensemble, optim
from functrain.checkpoint import restore_onto
from functrain.checkpoint.placed import strategy_of
from functrain.compile.tiers import TieredStep
from functrain.config import ConfigError, Problem, TrainerConfig
from functrain.distributed.data_ranks import data_ranks
from functrain.loop import FitResult, data_key, evaluate, fit, predict
from functrain.state import TrainState
from functrain.step import Step
from functrain.step.batch import inputs_and_target
from functrain.trainer import averaging, background, batches, build, run_dir, sharded_state, sweep

__all__ = ["Trainer"]


class Trainer:
    """Train a model as configured: ``Trainer(model, config, train_dataset, eval_dataset).train()``.

    Args:
        model: the ``nn.Module`` (its weights start the run; it is not modified).
        config: a :class:`TrainerConfig`, a dict, or a YAML path.
        train_dataset, eval_dataset: map-style datasets (``(inputs, target)`` samples or dicts with
            input/target keys), iterable datasets or ``DataLoader``s. Without ``eval_dataset`` the run
            evaluates nothing (``eval_strategy: auto``, the default: every epoch when it is given).
        data_collator: builds a batch from a list of samples.
        loss_fn: the loss of a batch, ``loss_fn(model, batch) -> loss`` or ``(loss, {"preds": ...,
            "target": ...})``, as everywhere in functrain (``make_train_step``, ``fit``); it replaces
            :meth:`compute_loss`'s default. Without it: a batch dict holding ``labels`` given to a model
            whose ``forward`` takes ``labels`` (Hugging Face's convention) runs ``model(**batch)`` and
            trains on the output's ``loss``, with ``logits`` and ``labels`` for the metrics; other batches
            are ``(inputs, target)`` for ``criterion``.
        criterion: ``criterion(preds, target) -> loss`` for ``(inputs, target)`` batches; default:
            ``config.criterion`` (a Hugging Face model's own loss is used unless ``config.criterion`` or
            this is set).
        optimizer: a :class:`functrain.optim.GradientTransformation`; default: ``config.optimizer`` and
            ``config.scheduler``.
        callbacks: extra :class:`functrain.callbacks.Callback` objects for this trainer's runs.

    Example:
        >>> import tempfile
        >>> run_dir = tempfile.TemporaryDirectory()
        >>> train_set = [(torch.randn(4), torch.tensor(i % 2)) for i in range(32)]
        >>> config = {"output_dir": run_dir.name, "epochs": 2, "batch_size": 8, "compile": False,
        ...           "progress_bar": False, "print_summary": False}
        >>> int(Trainer(torch.nn.Linear(4, 2), config, train_set).train().state.step)
        8
        >>> run_dir.cleanup()
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainerConfig | Mapping[str, Any] | str | os.PathLike[str],
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *,
        data_collator: Callable[[list[Any]], Any] | None = None,
        loss_fn: Callable[[Callable[..., Any], Any], Any] | None = None,
        criterion: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: optim.GradientTransformation | None = None,
        callbacks: Iterable[cbs.Callback] = (),
    ) -> None:
        self.config = cfg = _with_eval_strategy(_as_config(config), model, eval_dataset)
        self.model, self.data_collator = model, data_collator
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        criterion = batches.criterion_argument(criterion, loss_fn)
        self.loss_fn = loss_fn
        # A model that takes labels computes its own loss (Hugging Face); an explicit criterion wins.
        self.model_takes_labels = batches.forward_takes_labels(model)
        explicit = criterion is not None or cfg.criterion != type(cfg.criterion)()
        self.criterion = criterion if criterion is not None else build.criterion(cfg)
        self._use_model_loss = self.model_takes_labels and not explicit
        self.device = build.device(cfg)
        self.extra_callbacks = list(callbacks)
        self.metrics = build.metrics(cfg)
        self._optimizer_override = optimizer
        self.frozen = build.frozen(cfg, model)
        self.total_steps = build.total_steps(cfg, train_dataset)
        self.schedule = build.schedule(cfg, self.total_steps)
        self.tx = optimizer if optimizer is not None else self.build_optimizer()
        # config.sharding over the torchrun ranks (one process: a world of one); None: replicated, or
        # tensor-parallel (its strategy shards over the mesh's dp axis)
        self.sharding = build.sharding(cfg, model)
        # config.tensor_parallel: the step's strategy over a (dp, tp) mesh; None: off
        self.tensor_parallel = build.tensor_parallel(cfg, model, self.device)
        if cfg.sweep:
            self.state, self.sweep_members = sweep.state(cfg, model, self.tx, self.device)
        else:  # a tensor-parallel state placed: params and moments as DTensors, global rank 0's values
            self.state, self.init_report = build.initial_state(
                cfg, model, self.tx, self.device, self.sharding, self.tensor_parallel
            )
        self._build_steps()
        self._jitted: dict[str, Any] = {}
        self.result: FitResult | None = None

    # ------------------------------------------------------------------------------ extension points

    def compute_loss(self, model: Callable[..., Any], batch: Any) -> Any:
        """The loss of one batch: ``(loss, {"preds": ..., "target": ...})``. Override for custom models,
        or pass ``Trainer(loss_fn=...)``.

        ``model`` runs the network with the state's weights; the batch has been through
        :meth:`preprocess` (and :meth:`augment` when training). By default: ``loss_fn(model, batch)``
        when given; a batch dict with ``labels`` for a model that takes them: ``model(**batch)``, its
        output's ``loss``, ``logits`` as the predictions (Hugging Face); else ``criterion(model(inputs),
        target)``.
        """
        if self.loss_fn is not None:
            return self.loss_fn(model, batch)
        if self.model_takes_labels and isinstance(batch, Mapping) and "labels" in batch:
            own = None if self._use_model_loss else self.criterion
            return batches.labels_loss(model, batch, own, type(self.model).__name__)
        x, y = inputs_and_target(batch)
        preds = model(x)
        if self.model_takes_labels:
            batches.refuse_model_output(preds, type(self.model).__name__)
        return self.criterion(preds, y), {"preds": preds, "target": y}

    def preprocess(self, batch: Any) -> Any:
        """Batch -> batch, inside the compiled train and eval steps (normalisation, dtype casts)."""
        return batch

    def augment(self, batch: Any) -> Any:
        """Batch -> batch, inside the compiled train step only (random augmentation: draw from torch's
        global generator, which :func:`functrain.jit` seeds from the state before every step)."""
        return batch

    def build_optimizer(self) -> optim.GradientTransformation:
        """The optimizer from the config (override to build your own)."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        noise = build.dp_noise_multiplier(self.config, self.train_dataset, self.total_steps)
        return build.optimizer(self.config, self.schedule, params, self.frozen, noise)

    def train_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """One pure training step (override to change it; it is still compiled as one graph)."""
        return self._train_step(state, batch)

    def eval_step(self, state: TrainState, batch: Any) -> dict[str, Any]:
        """One pure evaluation step."""
        return self._eval_step(state, batch)

    # ------------------------------------------------------------------------------ public API

    def train(
        self, *, additional_epochs: int | None = None, additional_steps: int | None = None
    ) -> FitResult:
        """Run training as configured; returns the :class:`functrain.FitResult` (``self.state`` is updated).

        An ``output_dir`` holding an earlier run is resumed (``resume_from_checkpoint``), replaced
        (``overwrite_output_dir``) or, neither asked, left as it is: this run then writes the first free
        ``<output_dir>-N`` beside it (:func:`functrain.trainer.run_dir.resolve`; ``self.config.output_dir``
        names it). Saves the resolved config there, once the run has been checked against what the folder
        holds (the resumed checkpoint restored onto this model, the data non-empty): a refused run writes
        nothing there.

        ``epochs``/``max_steps`` are the run's total length: resuming a run that reached it, or that early
        stopping ended, returns its final state at once with a :class:`functrain.RunFinishedWarning`.
        ``additional_epochs``/``additional_steps`` train that much more from the current (or resumed)
        step instead, past an early stop too (the learning-rate schedule keeps its configured horizon).

        Example:
            >>> import tempfile
            >>> run_dir = tempfile.TemporaryDirectory()
            >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(32)]
            >>> config = TrainerConfig(output_dir=run_dir.name, epochs=2, batch_size=8, compile=False,
            ...                        progress_bar=False, print_summary=False, resume_from_checkpoint=True)
            >>> trainer = Trainer(torch.nn.Linear(4, 2), config, data)
            >>> int(trainer.train().state.step)  # epochs=2: 2 x 4 steps
            8
            >>> int(trainer.train(additional_epochs=1).state.step)  # one more, resumed from step 8
            12
            >>> run_dir.cleanup()
        """
        cfg = self.config
        if self.train_dataset is None:
            raise ValueError("Trainer.train: no train_dataset was given")
        train_loader = self._loader(
            self.train_dataset, cfg.batch_size * cfg.gradient_accumulation_steps, train=True
        )
        train_loader.require_batches("Trainer.train")
        out = run_dir.resolve(cfg)  # a rerun writes a new version beside the run output_dir holds
        if out != Path(cfg.output_dir):
            self.config = cfg = cfg.replace(output_dir=os.fspath(out))
        manager = self.checkpoint_manager()
        resume = run_dir.resume_argument(cfg)
        distributed.barrier()  # every rank checks the directory before rank 0 writes into it
        loggers = self._loggers(out / cfg.logs_dir)  # they write nothing before their first line
        start = run_dir.start_callback(cfg, out, self.model, self.frozen)
        extending = additional_epochs is not None or additional_steps is not None
        try:
            train_step, eval_step, eval_data = self._jit("train"), None, None
            if cfg.eval_strategy != "no":
                eval_step = self._jit("eval")
                eval_data = self._loader(self.eval_dataset, cfg.resolved_eval_batch_size, train=False)
            result = fit(
                self.state,
                train_step,
                train_loader,
                eval_step=eval_step,
                eval_data=eval_data,
                epochs=None if extending else cfg.epochs,
                max_steps=None if extending else cfg.max_steps,
                additional_epochs=additional_epochs,
                additional_steps=additional_steps,
                **build.every(cfg),
                callbacks=[start, *build.callbacks(cfg, self.extra_callbacks)],
                loggers=loggers,
                checkpoints=manager,
                resume_from_checkpoint=resume,
                progress_bar=cfg.progress_bar,
                check_batches=cfg.tensor_parallel_check_batches,
            )
        finally:  # also when training fails or is interrupted: W&B finishes its run, MLflow marks it
            for lg in loggers:  # finished, files are closed
                lg.close()
            if isinstance(self._jitted.get("train"), TieredStep):  # its background build, if any, ends
                self._jitted["train"].close()
        if cfg.load_best_model_at_end and manager.best() is not None:
            result.state = _with_best(cfg, result.state, manager.restore("best")["state"])
        self.state, self.result = result.state, result
        if cfg.sweep and distributed.is_main_process():
            self.sweep_best, self.sweep_results = sweep.report(cfg, result.history, self.sweep_members, out)
        return result

    def evaluate(self, dataset: Any = None) -> dict[str, float]:
        """Evaluate the current state on ``dataset`` (default: the eval dataset); example-weighted metrics.

        Example:
            >>> import tempfile
            >>> run_dir = tempfile.TemporaryDirectory()
            >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(32)]
            >>> config = {"output_dir": run_dir.name, "epochs": 1, "metrics": ["accuracy"], "compile": False}
            >>> trainer = Trainer(torch.nn.Linear(4, 2), config, data[:24], data[24:])
            >>> sorted(trainer.evaluate())  # the state as it is (untrained), on the eval dataset
            ['eval/accuracy', 'eval/loss']
            >>> run_dir.cleanup()
        """
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate: give a dataset (no eval_dataset was configured)")
        loader = self._loader(dataset, self.config.resolved_eval_batch_size, train=False)
        return evaluate(averaging.eval_state(self.config, self.state), self._jit("eval"), loader)

    def predict(self, dataset: Any) -> Any:
        """The model's outputs on every example of ``dataset``, concatenated (inputs taken as in training);
        after a sweep, ``{"members": [examples, n, ...], "mean": [examples, ...]}``."""
        loader = self._loader(dataset, self.config.resolved_eval_batch_size, train=False)
        state = averaging.eval_state(self.config, self.state)
        return predict(state, self._jit("predict"), loader, collect=True)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the train state (params, buffers, optimizer state, step, key) as a msgpack checkpoint.

        A sharded or tensor-parallel state (``config.sharding``, ``config.tensor_parallel``) is gathered
        whole first (every rank calls ``save``; rank 0 writes): the file is the one a single process
        training on the same data would save."""
        metadata = {"tied_parameters": dict(self.state.tied)}
        state = self.state if self.state.layout is None else self.state.layout.full_state(self.state)
        if self.state.layout is None or distributed.is_main_process():
            checkpoint.save(path, state, step=ensemble.run_step(self.state), metadata=metadata)
        distributed.barrier()

    def load(self, path: str | os.PathLike[str]) -> TrainState:
        """Load a state saved by :meth:`save` (or a checkpoint of ``fit``, a sharded one's
        ``step_N.shards`` folder or manifest included) onto this trainer's state; a tensor-parallel
        state reads a whole one (:meth:`save`'s) and is placed again (every rank calls ``load``)."""
        if self.tensor_parallel is not None:
            raw = checkpoint.restore(path)
            raw = raw.get("state", raw) if isinstance(raw, dict) else raw
            whole = restore_onto(self.tensor_parallel.gather(self.state), raw)
            self.state = self.tensor_parallel.place(whole)
            return self.state
        if self.state.layout is not None:
            self.state = sharded_state.load(self.state, path)
            return self.state
        raw = checkpoint.restore(path)
        raw = raw.get("state", raw) if isinstance(raw, dict) else raw
        self.state = restore_onto(self.state, raw)
        return self.state

    def checkpoint_manager(self) -> checkpoint.CheckpointManager:
        """The run's checkpoint folder as ``train()`` writes it (:func:`functrain.trainer.build.manager`):
        the CLI's eval/predict find the latest or best checkpoint of a run with it."""
        return build.manager(self.config, self.sharding)

    def best_member(self) -> TrainState:
        """After a sweep (``config.sweep``): the winning member's state, by the final
        ``metric_for_best_model`` (the training loss when nothing is evaluated).

        Example:
            >>> import tempfile
            >>> run_dir = tempfile.TemporaryDirectory()
            >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(32)]
            >>> config = TrainerConfig(output_dir=run_dir.name, epochs=1, batch_size=8, compile=False,
            ...                        progress_bar=False, print_summary=False,
            ...                        sweep={"optimizer.lr": [1e-3, 3e-3]})
            >>> trainer = Trainer(torch.nn.Linear(4, 2), config, data[:24], data[24:])
            >>> result = trainer.train()  # both learning rates at once, as one stacked state
            >>> trainer.best_member().params["weight"].shape  # the winner's state, one model's shapes
            torch.Size([2, 4])
            >>> run_dir.cleanup()
        """
        if not self.config.sweep:
            raise ValueError("Trainer.best_member: this run is not a sweep (set config.sweep)")
        if self.result is None:
            raise ValueError("Trainer.best_member: train first")
        return sweep.best_member(self.state, self.sweep_best)

    # ------------------------------------------------------------------------------ building

    def _build_steps(self) -> None:
        reducer, tp = None, self.tensor_parallel
        # a sharded state was made the same on every rank as it was created, a tp state as it was placed
        if tp is None and self.sharding is None:
            self.state, reducer = build.replicated(self.state, self.model, self.device)
        # which slice of the data this process reads: a tp group's ranks one together
        self.data_ranks = data_ranks(self.state)
        self._train_step, self._eval_step, self._predict_step = build.steps(
            self.config, self.model, _losses(self), self.metrics, reducer, self.sharding, tp
        )

    def _step(self, kind: str) -> Step:
        """The ``kind`` (``"train"``/``"eval"``/``"predict"``) step this trainer runs: the one it built, or
        a subclass's ``train_step``/``eval_step`` with the built one's fields, its batches as they are."""
        built = {"train": self._train_step, "eval": self._eval_step, "predict": self._predict_step}[kind]
        overridden = _overridden(self, kind)
        pads = build.pads(self.config, kind, overridden=overridden)
        fn = getattr(self, f"{kind}_step") if overridden else built.fn
        return built.replace(fn=fn, masked_batches=pads)

    def _jit(self, kind: str) -> Any:
        """The ``kind`` step compiled as the config asks (once per trainer)."""
        if kind not in self._jitted:
            rows = build.batch_rows(self.config, self.train_dataset) if kind == "train" else None
            building = background.background_build(self) if kind == "train" else None
            self._jitted[kind] = build.compiled(self.config, kind, self._step(kind), rows, building)
        return self._jitted[kind]

    def _loader(self, dataset: Any, batch_size: int, *, train: bool) -> Any:
        key = data_key(self.state) if train else None
        pad = train and build.pads(self.config, "train", overridden=_overridden(self, "train"))
        return build.loader(
            self.config, dataset, batch_size, key=key, device=self.device, collate_fn=self.data_collator,
            pad_last=pad, pad_token_id=batches.pad_token_id(self.model),
            ranks=(self.data_ranks.rank, self.data_ranks.world_size),
        )  # fmt: skip

    def _loggers(self, log_dir: Path) -> list[Any]:
        return build.loggers(self.config, log_dir)


def _overridden(trainer: Trainer, kind: str) -> bool:
    """Whether a subclass replaced the Trainer's ``train_step``/``eval_step`` (its batches stay as they are)."""
    return kind != "predict" and getattr(type(trainer), f"{kind}_step") is not getattr(
        Trainer, f"{kind}_step"
    )


def _losses(trainer: Trainer) -> build.Losses:
    """The Trainer's extension points (``preprocess``, ``augment``, ``compute_loss``) as the steps' losses."""

    def train_loss(model: Callable[..., Any], batch: Any) -> Any:
        return trainer.compute_loss(model, trainer.augment(trainer.preprocess(batch)))

    def eval_loss(model: Callable[..., Any], batch: Any) -> Any:
        return trainer.compute_loss(model, trainer.preprocess(batch))

    def forward(model: Callable[..., Any], batch: Any) -> Any:
        return batches.predict_forward(model, trainer.preprocess(batch), trainer.model_takes_labels)

    return build.Losses(train_loss, eval_loss, forward)


def _with_best(config: TrainerConfig, state: TrainState, best: Mapping[str, Any]) -> TrainState:
    """``state`` with the best checkpoint's weights (and their average with them: ``config.ema``). A
    tensor-parallel state is gathered, given them whole and placed again (collective): its fields alone
    are DTensors (row pieces under ZeRO) that the file's whole tensors would replace as plain ones."""
    fields = averaging.restored_fields(config)
    strategy = strategy_of(state)
    whole = state if strategy is None else strategy.gather(state)
    whole = whole.replace(**{f: restore_onto(getattr(whole, f), best[f], f"state.{f}") for f in fields})
    return whole if strategy is None else strategy.place(whole)


def _as_config(config: TrainerConfig | Mapping[str, Any] | str | os.PathLike[str]) -> TrainerConfig:
    if isinstance(config, TrainerConfig):
        return config
    if isinstance(config, Mapping):
        return TrainerConfig.from_dict(dict(config))
    return TrainerConfig.from_yaml(config)


def _with_eval_strategy(config: TrainerConfig, model: Any, eval_dataset: Any) -> TrainerConfig:
    """``config`` with ``eval_strategy: auto`` resolved: ``epoch`` with an eval set, else ``no``. An explicit
    ``epoch``/``steps`` (or evaluation that a field needs) without an eval set is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Trainer: model must be an nn.Module, got {type(model).__name__}")
    if eval_dataset is not None:
        return config.replace(eval_strategy=config.evaluates_every)
    fix = "pass Trainer(eval_dataset=...) (in a YAML config: eval_dataset: module:attr)"
    if config.eval_strategy not in ("auto", "no"):
        raise ConfigError.single(
            "eval_strategy",
            f"eval_strategy={config.eval_strategy!r} but no eval_dataset was given",
            f"{fix}, or set eval_strategy: auto (evaluates only when there is an eval set)",
        )
    needs = {"early_stopping": config.early_stopping, "load_best_model_at_end": config.load_best_model_at_end}
    problems = [
        Problem(field, "needs evaluation results, but no eval_dataset was given", f"{fix}, or remove {field}")
        for field, value in needs.items()
        if value
    ]
    if problems:
        raise ConfigError(problems)
    return config.replace(eval_strategy="no")
