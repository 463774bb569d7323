"""`Trainer`: the facade over state, steps and loop, configured by a `TrainerConfig`.

What users of Towhee's, LiBai's, Hezar's and Kornia's trainers expect — configs by name and YAML,
callbacks, metrics, TensorBoard, early stopping, checkpoints, mixed precision, accumulation — built from
functrain's pure pieces: every config field is consumed here (none is accepted and ignored).

Extension points, as in the seed trainers, by subclassing: ``compute_loss(model, batch)``,
``preprocess(batch)`` and ``augment(batch)`` (run *inside* the compiled step), ``build_optimizer()``,
``build_schedule(total_steps)``, and ``train_step``/``eval_step`` themselves (pure functions of
``(state, batch)``; the default ones are built by :func:`functrain.make_train_step`).

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    >>> config = ft.TrainerConfig(output_dir="runs/digits", epochs=3, metrics=["accuracy"], compile=False)
    >>> trainer = ft.Trainer(model, config, train_dataset=train_set, eval_dataset=val_set)
    >>> result = trainer.train()
    >>> trainer.evaluate(test_set)["eval/accuracy"]
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from functrain import averaging, checkpoint, data, distributed, ensemble, metrics, optim
from functrain import callbacks as cbs
from functrain import logging as ftlog
from functrain.config import ConfigError, TrainerConfig
from functrain.ensemble import sweep as ensemble_sweep
from functrain.jit import jit
from functrain.loop import FitResult, _onto, data_key, evaluate, fit
from functrain.model_summary import summary
from functrain.precision import LossScale
from functrain.state import TrainState
from functrain.step import _INPUT_KEYS, _inputs_and_target, make_eval_step, make_predict_step, make_train_step

__all__ = ["Trainer", "build_optimizer", "build_schedule", "resolve_device"]

_TORCH_ARG_NAMES = {"betas": ("b1", "b2")}

# Inside output_dir: torch's portable compile cache (functrain.jit's cache_dir), kept across runs.
COMPILE_CACHE_DIR = "compile-cache"


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; other names are checked against this machine.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if name == "auto":
        if torch.cuda.is_available():
            return (
                torch.device("cuda", distributed.local_rank())
                if distributed.is_distributed()
                else torch.device("cuda")
            )
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError.single(
            "device", f"device={name!r} but CUDA is not available here", "use device=cpu or auto"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError.single(
            "device", f"device={name!r} but MPS is not available here", "use device=cpu or auto"
        )
    return device


def build_schedule(config: TrainerConfig, total_steps: int) -> optim.Schedule | float:
    """The learning-rate schedule of ``config.scheduler`` over ``total_steps`` optimizer steps.

    Warm-up (``warmup_steps`` or ``warmup_ratio`` of the total) rises linearly from 0 to
    ``optimizer.lr`` and the named schedule takes over after it. Every count is in optimizer steps.

    Example:
        >>> cfg = TrainerConfig(max_steps=100, scheduler={"name": "cosine", "warmup_steps": 10})
        >>> float(build_schedule(cfg, 100)(10))
        0.001
    """
    sc, lr = config.scheduler, config.optimizer.lr
    warmup = (
        sc.warmup_steps if sc.warmup_steps is not None else math.floor((sc.warmup_ratio or 0.0) * total_steps)
    )
    if warmup >= total_steps and total_steps > 0 and warmup > 0:
        raise ConfigError.single(
            "scheduler.warmup_steps",
            f"warm-up of {warmup} steps is not shorter than the run ({total_steps} steps)",
            "lower warmup_steps/warmup_ratio or train longer",
        )
    rest = max(total_steps - warmup, 1)
    args = dict(sc.args)
    name = sc.name
    try:
        if name == "constant":
            main: Any = optim.constant_schedule(lr)
        elif name == "linear":
            main = optim.linear_schedule(lr, args.pop("end_value", 0.0), rest)
        elif name in ("cosine", "warmup_cosine"):
            main = optim.cosine_decay_schedule(lr, rest, **args)
        elif name == "exponential":
            main = optim.exponential_decay(
                lr, args.pop("transition_steps", 1), args.pop("decay_rate", 0.96), **args
            )
        elif name == "step":
            step_size, gamma = args.pop("step_size"), args.pop("gamma", 0.1)
            boundaries = {k * step_size: gamma for k in range(1, max(rest // step_size, 0) + 1)}
            main = optim.piecewise_constant_schedule(lr, boundaries)
        elif name == "piecewise":
            main = optim.piecewise_constant_schedule(
                lr, {int(k): float(v) for k, v in args.pop("boundaries_and_scales").items()}
            )
        elif name == "polynomial":
            main = optim.polynomial_schedule(lr, args.pop("end_value", 0.0), args.pop("power", 1.0), rest)
        elif name == "one_cycle":
            if warmup:
                raise ConfigError.single(
                    "scheduler.warmup_steps",
                    "one_cycle has its own warm-up phase",
                    "set pct_start in scheduler.args instead",
                )
            return optim.one_cycle_schedule(total_steps, lr, **args)
        else:  # the config validates names; this guards the two lists drifting apart
            raise ConfigError.single(
                "scheduler.name", f"unknown schedule {name!r}", "see functrain train --help-config"
            )
    except (TypeError, KeyError) as err:
        raise ConfigError.single(
            "scheduler.args", f"bad arguments for schedule {name!r}: {err}", "check the schedule's arguments"
        ) from err
    if args and name not in ("cosine", "warmup_cosine", "exponential", "one_cycle"):
        raise ConfigError.single(
            "scheduler.args", f"unused arguments {sorted(args)} for schedule {name!r}", "remove them"
        )
    if not warmup:
        return main
    return optim.join_schedules(
        [optim.linear_schedule(0.0, lr, warmup), lambda count: main(count - warmup)], [warmup]
    )


def build_optimizer(
    config: TrainerConfig, learning_rate: Any, params: Mapping[str, torch.Tensor], frozen: set[str]
) -> optim.GradientTransformation:
    """The optimizer of ``config.optimizer``, with gradient clipping and frozen parameters.

    ``optimizer.args`` take functrain's names or torch's (``betas: [0.9, 0.999]``).

    Example:
        >>> tx = build_optimizer(TrainerConfig(max_steps=10), 1e-3, {"w": torch.zeros(2)}, set())
    """
    oc = config.optimizer
    factory = getattr(optim, oc.name)
    kwargs: dict[str, Any] = {}
    for key, value in oc.args.items():
        if key in _TORCH_ARG_NAMES:
            kwargs.update(zip(_TORCH_ARG_NAMES[key], value))
        else:
            kwargs[key] = value
    kwargs["weight_decay"] = oc.weight_decay
    try:
        tx = factory(learning_rate, **kwargs)
    except TypeError as err:
        import inspect

        known = [p for p in inspect.signature(factory).parameters if p != "learning_rate"]
        raise ConfigError.single("optimizer.args", f"{err}", f"{oc.name} takes {known}") from err
    if frozen:
        tx = optim.freeze(tx, {name: name in frozen for name in params})
    if config.max_grad_norm is not None:
        tx = optim.chain(optim.clip_by_global_norm(config.max_grad_norm), tx)
    if config.ema is not None:  # last: it averages the params this update produces
        tx = optim.chain(tx, averaging.ema(config.ema.decay, warmup=config.ema.warmup))
    return tx


class Trainer:
    """Train a model as configured: ``Trainer(model, config, train_dataset, eval_dataset).train()``.

    Args:
        model: the ``nn.Module`` (its weights start the run; it is not modified).
        config: a :class:`TrainerConfig`, a dict, or a YAML path.
        train_dataset, eval_dataset: map-style datasets (``(inputs, target)`` samples or dicts with
            input/target keys), iterable datasets or ``DataLoader``s.
        data_collator: builds a batch from a list of samples.
        loss_fn: the loss of a batch, ``loss_fn(model, batch) -> loss`` or ``(loss, {"preds": ...,
            "target": ...})``, as everywhere in functrain (``make_train_step``, ``fit``); it replaces
            :meth:`compute_loss`'s default. Without it: a batch dict holding ``labels`` given to a model
            whose ``forward`` takes ``labels`` (Hugging Face's convention) runs ``model(**batch)`` and
            trains on the output's ``loss``, with ``logits`` and ``labels`` for the metrics; other batches
            are ``(inputs, target)`` for ``criterion``.
        criterion: ``criterion(preds, target) -> loss`` for ``(inputs, target)`` batches; default:
            ``config.loss`` (a Hugging Face model's own loss is used unless ``config.loss`` or this is set).
        loss: deprecated alias of ``criterion`` (a ``DeprecationWarning``; removed in the next release).
        optimizer: a :class:`functrain.optim.GradientTransformation`; default: ``config.optimizer`` and
            ``config.scheduler``.
        callbacks: extra :class:`functrain.callbacks.Callback` objects for this trainer's runs.

    Example:
        >>> trainer = Trainer(model, {"output_dir": "runs/a", "epochs": 2, "compile": False}, train_set)
        >>> trainer.train().state.step
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
        loss: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> None:
        if isinstance(config, TrainerConfig):
            self.config = config
        elif isinstance(config, Mapping):
            self.config = TrainerConfig.from_dict(dict(config))
        else:
            self.config = TrainerConfig.from_yaml(config)
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer: model must be an nn.Module, got {type(model).__name__}")
        cfg = self.config
        if cfg.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError.single(
                "eval_strategy",
                f"eval_strategy={cfg.eval_strategy!r} but no eval_dataset was given",
                "pass eval_dataset=... or set eval_strategy: 'no'",
            )
        self.model = model
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = data_collator
        if loss is not None:
            warnings.warn(
                "Trainer(loss=...) is deprecated: it is the criterion(preds, target); pass criterion=... "
                "(or loss_fn=(model, batch) -> loss for the whole loss)",
                DeprecationWarning,
                stacklevel=2,
            )
            if criterion is not None:
                raise TypeError("Trainer: give criterion=... only (loss= is its deprecated name)")
            criterion = loss
        if loss_fn is not None and criterion is not None:
            raise TypeError(
                "Trainer: give loss_fn(model, batch) or criterion(preds, target), not both (loss_fn "
                "computes the whole loss, so the criterion would never be used)"
            )
        self.loss_fn = loss_fn
        # A model that takes labels computes its own loss (Hugging Face); an explicit criterion wins.
        self.model_takes_labels = _forward_takes_labels(model)
        explicit = criterion is not None or cfg.loss != type(cfg.loss)()
        self.criterion = criterion if criterion is not None else self._build_criterion()
        self._use_model_loss = self.model_takes_labels and not explicit
        self.device = resolve_device(cfg.device)
        if cfg.mixed_precision == "fp16" and self.device.type != "cuda":
            raise ConfigError.single(
                "mixed_precision",
                f"fp16 needs a CUDA device, the run uses {self.device}",
                "use bf16 on the CPU",
            )
        self.extra_callbacks = list(callbacks)
        self.metrics = self._build_metrics()
        self._optimizer_override = optimizer
        self.frozen = self._frozen_names()
        self.total_steps = self._total_steps()
        self.schedule = build_schedule(cfg, self.total_steps)
        self.tx = optimizer if optimizer is not None else self.build_optimizer()
        self.state = self._initial_state()
        reducer = None
        if distributed.is_distributed():  # torchrun: same start on every rank, gradients averaged in the step
            self.state = distributed.replicate(self.state, device=self.device)
            reducer = distributed.gradient_reducer(model=model)
        self._train_step = make_train_step(
            model,
            self._loss_for_training,
            accumulate=cfg.gradient_accumulation_steps,
            precision=self._precision,
            metrics=None,
            freeze_batchnorm=cfg.freeze.batchnorm,
            gradient_reducer=reducer,
        )
        if cfg.nonfinite != "ignore":  # inside the ensemble's vmap below: each member skips on its own
            self._train_step = cbs.skip_nonfinite(self._train_step)
        self._eval_step = make_eval_step(
            model, self._loss_for_eval, metrics=self.metrics, precision=self._precision
        )
        self._predict_step = make_predict_step(model, self._forward_for_predict, precision=self._precision)
        if cfg.sweep:
            self._ensemble_steps()
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
            out = model(**batch)
            logits = _output_field(out, "logits", 1)
            if self._use_model_loss:
                loss = _output_field(out, "loss", 0)
                if loss is None:
                    raise ValueError(
                        f"Trainer: {type(self.model).__name__} returned no loss for a batch with labels; "
                        "pass criterion=... (applied to its logits) or loss_fn=(model, batch) -> loss"
                    )
            else:
                loss = self.criterion(logits, batch["labels"])
            return loss, {"preds": logits, "target": batch["labels"]}
        x, y = _inputs_and_target(batch)
        preds = model(x)
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
        return build_optimizer(self.config, self.schedule, self._param_names_dict(), self.frozen)

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

        Refuses to start in an ``output_dir`` holding an earlier run unless ``overwrite_output_dir`` or
        ``resume_from_checkpoint`` says what to do with it. Saves the resolved config there, once the run
        has been checked against what the folder holds (the resumed checkpoint restored onto this model,
        the data non-empty): a refused run writes nothing there.

        ``epochs``/``max_steps`` are the run's total length: resuming a run that reached it, or that early
        stopping ended, returns its final state at once with a :class:`functrain.RunFinishedWarning`.
        ``additional_epochs``/``additional_steps`` train that much more from the current (or resumed)
        step instead, past an early stop too (the learning-rate schedule keeps its configured horizon).

        Example:
            >>> trainer.train()  # epochs=10
            >>> trainer.train(additional_epochs=5)  # 5 more, with resume_from_checkpoint: true
        """
        cfg = self.config
        if self.train_dataset is None:
            raise ValueError("Trainer.train: no train_dataset was given")
        train_loader = self._loader(
            self.train_dataset, cfg.batch_size * cfg.gradient_accumulation_steps, train=True
        )
        train_loader.require_batches("Trainer.train")
        out = Path(cfg.output_dir)
        self._check_output_dir(out)
        manager = self.checkpoint_manager()
        resume = self._resume_argument(manager)
        distributed.barrier()  # every rank checks the directory before rank 0 writes into it
        loggers = self._loggers(out / cfg.logs_dir)  # they write nothing before their first line
        # fit restores the checkpoint (refusing one of another model) before train_begin, the first event
        start = cbs.LambdaCallback("run_directory", on_train_begin=lambda s, ctx: self._start_run(out) or s)
        extending = additional_epochs is not None or additional_steps is not None
        try:
            result = fit(
                self.state,
                self._jit("train", self.train_step),
                train_loader,
                eval_step=self._jit("eval", self.eval_step) if cfg.eval_strategy != "no" else None,
                eval_data=self._loader(self.eval_dataset, cfg.resolved_eval_batch_size, train=False)
                if cfg.eval_strategy != "no"
                else None,
                epochs=None if extending else cfg.epochs,
                max_steps=None if extending else cfg.max_steps,
                additional_epochs=additional_epochs,
                additional_steps=additional_steps,
                eval_every=self._every(cfg.eval_strategy, cfg.eval_steps),
                save_every=self._every(cfg.save_strategy, cfg.save_steps),
                log_every=cfg.log_steps,
                callbacks=[start, *self._callbacks()],
                loggers=loggers,
                checkpoints=manager,
                resume=resume,
                progress_bar=cfg.progress_bar,
            )
        finally:  # also when training fails or is interrupted: W&B finishes its run, MLflow marks it
            for lg in loggers:  # finished, files are closed
                lg.close()
        state = result.state
        if cfg.load_best_model_at_end and manager.best() is not None:
            best = manager.restore("best")["state"]
            state = state.replace(
                params=_onto(state.params, best["params"], "state.params"),
                buffers=_onto(state.buffers, best["buffers"], "state.buffers"),
            )
            if cfg.ema is not None:  # and the best checkpoint's average
                state = state.replace(opt_state=_onto(state.opt_state, best["opt_state"], "state.opt_state"))
            result.state = state
        self.state = state
        self.result = result
        if cfg.sweep and distributed.is_main_process():
            self._report_sweep(result, out)
        return result

    def evaluate(self, dataset: Any = None) -> dict[str, float]:
        """Evaluate the current state on ``dataset`` (default: the eval dataset); example-weighted metrics.

        Example:
            >>> trainer.evaluate(test_set)
            {'eval/loss': 0.08, 'eval/accuracy': 0.977}
        """
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate: give a dataset (no eval_dataset was configured)")
        loader = self._loader(dataset, self.config.resolved_eval_batch_size, train=False)
        return evaluate(self._eval_state(), self._jit("eval", self.eval_step), loader)

    def predict(self, dataset: Any) -> Any:
        """The model's outputs on every example of ``dataset``, concatenated (inputs taken as in training);
        after a sweep, ``{"members": [examples, n, ...], "mean": [examples, ...]}``."""
        from functrain.loop import predict

        loader = self._loader(dataset, self.config.resolved_eval_batch_size, train=False)
        return predict(self._eval_state(), self._jit("predict", self._predict_step), loader, collect=True)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the train state (params, buffers, optimizer state, step, key) as a msgpack checkpoint."""
        checkpoint.save(
            path,
            self.state,
            step=ensemble.run_step(self.state),
            metadata={"tied_parameters": dict(self.state.tied)},
        )

    def load(self, path: str | os.PathLike[str]) -> TrainState:
        """Load a state saved by :meth:`save` (or a checkpoint of ``fit``) onto this trainer's state."""
        raw = checkpoint.restore(path)
        raw = raw.get("state", raw) if isinstance(raw, dict) else raw
        self.state = _onto(self.state, raw)
        return self.state

    # ------------------------------------------------------------------------------ building

    def _eval_state(self) -> TrainState:
        """The state evaluations and predictions use: with ``ema.evaluate``, the averaged weights."""
        ema = self.config.ema
        return averaging.with_averaged_params(self.state) if ema is not None and ema.evaluate else self.state

    @property
    def _precision(self) -> str | None:
        return None if self.config.mixed_precision == "no" else self.config.mixed_precision

    def checkpoint_manager(self) -> checkpoint.CheckpointManager:
        """The run's checkpoint folder as ``train()`` writes it: retention, and the best model by
        ``metric_for_best_model`` when the run evaluates. Opening it reads only (the CLI's eval/predict
        use it to find the latest or best checkpoint of a run).

        Example:
            >>> trainer.checkpoint_manager().latest()  # doctest: +SKIP
            200
        """
        cfg = self.config
        evaluates = cfg.eval_strategy != "no"
        return checkpoint.CheckpointManager(
            Path(cfg.output_dir) / cfg.checkpoints_dir,
            max_to_keep=cfg.save_total_limit,
            best_metric=self._best_metric if evaluates else None,
            best_mode=cfg.resolved_best_model_mode or "min",
            keep_best=1 if evaluates else 0,
        )

    @property
    def _best_metric(self) -> str:
        return f"eval/{self.config.metric_for_best_model}"

    def _build_criterion(self) -> Callable[[Any, Any], torch.Tensor]:
        name, args = self.config.loss.name, dict(self.config.loss.args)
        if ":" in name:
            from functrain.config import resolve_object

            cls = resolve_object(name, path="loss.name")
        else:
            cls = getattr(nn, name)
        return cls(**args) if isinstance(cls, type) else cls

    def _build_metrics(self) -> metrics.Collection | None:
        if not self.config.metrics:
            return None
        built = {}
        for name, args in self.config.metrics.items():
            try:
                built[name] = metrics.metric_from_spec({"name": name, **args})
            except (KeyError, ValueError, TypeError) as err:
                raise ConfigError.single(
                    f"metrics.{name}", str(err), "see functrain.metrics.available_metrics()"
                ) from err
        return metrics.Collection(built)

    def _frozen_names(self) -> set[str]:
        fc = self.config.freeze
        params = self._param_names_dict()
        names: set[str] = set()
        if fc.patterns:
            mask = optim.mask_by_name(params, fc.patterns)
            names |= {k for k, v in mask.items() if v}
        if fc.module_indices:
            names |= set(optim.names_by_module_index(self.model, fc.module_indices))
        if fc.batchnorm:
            names |= set(optim.batchnorm_param_names(self.model))
        return names & set(params)

    def _param_names_dict(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def _total_steps(self) -> int:
        cfg = self.config
        if cfg.max_steps is not None:
            return cfg.max_steps
        try:
            n = len(self.train_dataset)
        except TypeError:
            raise ConfigError.single(
                "epochs",
                "the train dataset has no length, so epochs cannot be counted",
                "set max_steps instead",
            ) from None
        per_epoch = data.num_batches(
            n, cfg.batch_size * cfg.gradient_accumulation_steps, cfg.drop_last, distributed.world_size()
        )
        return per_epoch * cfg.epochs

    def _initial_state(self) -> TrainState:
        cfg = self.config
        if cfg.sweep:
            return self._sweep_state()
        state = TrainState.create(
            self.model,
            self.tx,
            seed=cfg.seed,
            device=self.device,
            loss_scale=LossScale.create() if cfg.mixed_precision == "fp16" else None,
        )
        if cfg.init_weights_from:
            state, report = checkpoint.init_weights_from(
                cfg.init_weights_from, state, tied_parameters=dict(state.tied)
            )
            self.init_report = report
            if not report.loaded:
                raise ConfigError.single(
                    "init_weights_from",
                    f"no weight of {cfg.init_weights_from} matches the model by name and shape",
                    "check the file and the model",
                )
        return state

    def _loss_for_training(self, model: Callable[..., Any], batch: Any) -> Any:
        return self.compute_loss(model, self.augment(self.preprocess(batch)))

    def _loss_for_eval(self, model: Callable[..., Any], batch: Any) -> Any:
        return self.compute_loss(model, self.preprocess(batch))

    def _forward_for_predict(self, model: Callable[..., Any], batch: Any) -> Any:
        batch = self.preprocess(batch)
        if isinstance(batch, torch.Tensor):
            return model(batch)
        if (
            self.model_takes_labels
            and isinstance(batch, Mapping)
            and not any(k in batch for k in _INPUT_KEYS)
        ):
            # a Hugging Face batch (input_ids, attention_mask, ...): the logits, without computing a loss
            return _output_field(model(**{k: v for k, v in batch.items() if k != "labels"}), "logits", 0)
        try:
            x, _ = _inputs_and_target(batch)
        except (KeyError, TypeError):
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return model(x)

    def _jit(self, kind: str, fn: Callable[..., Any]) -> Any:
        if kind not in self._jitted:
            cfg = self.config
            self._jitted[kind] = jit(
                fn,
                compile=cfg.compile,
                mode=cfg.compile_mode,
                donate=cfg.donate and kind == "train",
                dynamic=None if kind != "train" else False,
                # torch's portable compile cache in the run directory (opt-in: its files are pickles)
                cache_dir=Path(cfg.output_dir) / COMPILE_CACHE_DIR if cfg.compile_cache else None,
            )
            # the loop finds these on the step (a bound method carries no attributes of its own)
            self._jitted[kind].metrics = getattr(self._eval_step, "metrics", None) if kind == "eval" else None
            self._jitted[kind].gradient_reducer = getattr(self._train_step, "gradient_reducer", None)
        return self._jitted[kind]

    def _loader(self, dataset: Any, batch_size: int, *, train: bool) -> data.Loader:
        cfg = self.config
        if isinstance(dataset, data.Loader):
            return dataset
        if isinstance(dataset, torch.utils.data.DataLoader):
            return data.Loader(dataset)

        rank, world = distributed.rank(), distributed.world_size()
        return data.Loader(
            dataset,
            batch_size,
            shuffle=cfg.shuffle if train else False,
            key=data_key(self.state) if train else None,
            drop_last=cfg.drop_last if train else False,
            collate_fn=self.data_collator,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            device=self.device,
            rank=rank,
            world_size=world,
        )

    @staticmethod
    def _every(strategy: str, steps: int | None) -> int | str | None:
        return {"no": None, "epoch": "epoch", "steps": steps}[strategy]

    def _callbacks(self) -> list[cbs.Callback]:
        cfg = self.config
        out: list[cbs.Callback] = [cbs.LearningRateMonitor(), cbs.Timer(), cbs.Preemption()]
        if cfg.early_stopping is not None:
            es = cfg.early_stopping
            out.append(
                cbs.EarlyStopping(
                    f"eval/{es.monitor}",
                    mode=es.resolved_mode or "min",
                    patience=es.patience,
                    min_delta=es.min_delta,
                )
            )
        if cfg.print_steps:
            out.append(cbs.PrintMetrics(every=cfg.print_steps))
        if cfg.ema is not None and cfg.ema.evaluate:
            out.append(averaging.AveragedEvaluation())
        if cfg.nonfinite != "ignore":
            stop = cfg.nonfinite == "stop"
            out.append(
                cbs.SkippedSteps(1 if stop else cfg.resolved_max_consecutive_nonfinite, every_step=stop)
            )
        return out + self.extra_callbacks

    def _loggers(self, log_dir: Path) -> list[Any]:
        if distributed.rank() != 0:
            return []
        cfg = self.config
        loggers: list[Any] = []
        if cfg.jsonl:
            loggers.append(ftlog.JSONLWriter(log_dir))
        if cfg.csv:
            loggers.append(ftlog.CSVWriter(log_dir))
        if cfg.tensorboard:
            loggers.append(ftlog.TensorBoardWriter(log_dir / "tensorboard"))
        run_name = Path(cfg.output_dir).name
        if "wandb" in cfg.report_to:
            loggers.append(ftlog.WandbWriter(log_dir, name=run_name, config=cfg.to_dict()))
        if "mlflow" in cfg.report_to:
            loggers.append(ftlog.MLflowWriter(log_dir, run_name=run_name))
        return loggers

    def _start_run(self, out: Path) -> None:
        """Write the run directory: the run has been checked against it (see :meth:`train`)."""
        cfg = self.config
        if not distributed.is_main_process():
            return
        if cfg.overwrite_output_dir and not cfg.resume_from_checkpoint and out.exists():
            import shutil

            for sub in (cfg.checkpoints_dir, cfg.logs_dir):
                shutil.rmtree(out / sub, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / "config.yaml")
        if cfg.print_summary:
            print(summary(self.model, frozen=self.frozen))

    def _check_output_dir(self, out: Path) -> None:
        """Refuse an ``output_dir`` holding a run unless the config says to overwrite or resume it."""
        cfg = self.config
        if (
            not out.exists()
            or not any(p.name != COMPILE_CACHE_DIR for p in out.iterdir())
            or cfg.overwrite_output_dir
            or cfg.resume_from_checkpoint
        ):
            return
        raise FileExistsError(
            f"output_dir {str(out)!r} already holds a run; set overwrite_output_dir: true to replace it, "
            "resume_from_checkpoint: true to continue it, or choose another output_dir"
        )

    def _resume_argument(self, manager: checkpoint.CheckpointManager) -> Any:
        r = self.config.resume_from_checkpoint
        if r is False:
            return False
        if r is True:
            return True
        path = Path(r)
        if not path.exists():
            raise ConfigError.single(
                "resume_from_checkpoint", f"no checkpoint at {r}", "give an existing checkpoint file or true"
            )
        return os.fspath(path)

    # ------------------------------------------------------------------------------ sweeps

    def best_member(self) -> TrainState:
        """After a sweep (``config.sweep``): the winning member's state, by the final
        ``metric_for_best_model`` (the training loss when nothing is evaluated).

        Example:
            >>> trainer = Trainer(model, TrainerConfig(epochs=3, sweep={"optimizer.lr": [1e-3, 3e-3]}), train, val)
            >>> trainer.train(); best = trainer.best_member()
        """
        if not self.config.sweep:
            raise ValueError("Trainer.best_member: this run is not a sweep (set config.sweep)")
        if self.result is None:
            raise ValueError("Trainer.best_member: train first")
        return ensemble.member(self.state, self.sweep_best)

    def _sweep_state(self) -> TrainState:
        cfg = self.config
        unsupported = "init_weights_from" if cfg.init_weights_from else None
        if distributed.is_distributed():
            unsupported = "data parallelism (torchrun)"
        if unsupported:
            raise ConfigError.single(
                "sweep",
                f"a sweep trains its members as one ensemble, which does not support {unsupported}",
                "run one training per value instead of a sweep",
            )
        self.sweep_members = ensemble_sweep.grid(cfg.sweep)
        try:
            return ensemble_sweep.sweep_state(
                self.model,
                self.tx,
                self.sweep_members,
                seed=cfg.seed,
                base_lr=cfg.optimizer.lr,
                device=self.device,
                loss_scale=LossScale.create() if cfg.mixed_precision == "fp16" else None,
            )
        except ValueError as err:
            raise ConfigError.single("sweep", str(err), "sweep optimizer.lr or seed instead") from err

    def _ensemble_steps(self) -> None:
        self._train_step = ensemble.step(self._train_step)
        self._eval_step = ensemble.eval_step(self._eval_step)
        self._predict_step = ensemble.predict_step(self._predict_step)

    def _report_sweep(self, result: FitResult, out: Path) -> None:
        cfg = self.config
        rows = ensemble_sweep.results(result.history, self.sweep_members)
        evaluated = f"{self._best_metric} (final)" in rows[0]  # every row has the same columns
        metric, mode = (
            (self._best_metric, cfg.resolved_best_model_mode) if evaluated else ("train/loss", "min")
        )
        self.sweep_best = ensemble_sweep.best_index(rows, metric, mode)
        self.sweep_results = rows
        ensemble_sweep.write_results(rows, out, best=self.sweep_best)
        ensemble_sweep.plot_sweep(result.history, self.sweep_members, out / "sweep_curves.png")


def _forward_takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``labels`` (a Hugging Face model computes its loss from them)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension's forward)
        return False


def _output_field(out: Any, name: str, position: int) -> Any:
    """``out.<name>`` of a model output: a Hugging Face ``ModelOutput`` (a mapping with attributes), a
    dict, or the tuple of ``return_dict=False`` (``(loss, logits, ...)`` with labels, ``(logits, ...)``
    without); a plain tensor is its own logits."""
    if isinstance(out, torch.Tensor):
        return out if name == "logits" else None
    if isinstance(out, Mapping):
        return out.get(name)
    if isinstance(out, Sequence) and len(out) > position:
        return out[position]
    return getattr(out, name, None)
