"""Pure builders: a :class:`~functrain.config.TrainerConfig` (and the model or data it describes) -> one
piece of the run. The :class:`~functrain.trainer.Trainer` is these put together; each can be used alone.

- :func:`optimizer`, :func:`schedule` (from the table :data:`functrain.config.schedules.SCHEDULES`),
  :func:`criterion`, :func:`metrics`, :func:`callbacks`, :func:`loggers` (the table :data:`LOGGERS`),
  :func:`manager` (the checkpoint folder), :func:`loader`, :func:`frozen`, :func:`total_steps`,
  :func:`sharding`, :func:`tensor_parallel` (and its :func:`tensor_parallel_plan`), :func:`initial_state`,
  :func:`steps` (train/eval/predict), :func:`compiled` (their ``jit``),
  :func:`every` (fit's eval/save/log periods), :func:`resolve_device`.

Example:
    >>> import functrain as ft
    >>> cfg = ft.TrainerConfig(max_steps=100, scheduler={"name": "cosine", "warmup_steps": 10})
    >>> round(float(schedule(cfg, 100)(10)), 6)
    0.001
"""

from __future__ import annotations

import fnmatch
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, get_args

import torch
from torch import nn

from functrain import callbacks as cbs
from functrain import checkpoint, data, distributed, ensemble, optim
from functrain import logging as ftlog
from functrain import metrics as ftmetrics
from functrain.checkpoint.sharded import ShardedCheckpointManager
from functrain.compile.tiers import TieredStep, tiered
from functrain.config import ConfigError, TrainerConfig
from functrain.config.schedules import SCHEDULES
from functrain.config.section import type_hints
from functrain.distributed.block_spec import unknown_block_names
from functrain.distributed.sharding import local_rows
from functrain.precision import LossScale
from functrain.state import TrainState
from functrain.step import Step, make_eval_step, make_predict_step, make_train_step
from functrain.trainer import averaging
from functrain.trainer.run_dir import COMPILE_CACHE_DIR

if TYPE_CHECKING:
    from functrain.distributed.tensor_parallel import Plan, TensorParallel
    from functrain.jit import CompiledStep

__all__ = [
    "LOGGERS",
    "Losses",
    "batch_rows",
    "best_metric",
    "callbacks",
    "compiled",
    "criterion",
    "device",
    "every",
    "frozen",
    "initial_state",
    "loader",
    "loggers",
    "manager",
    "metrics",
    "optimizer",
    "replicated",
    "resolve_device",
    "schedule",
    "sharding",
    "steps",
    "tensor_parallel",
    "tensor_parallel_plan",
    "total_steps",
]

_TORCH_ARG_NAMES = {"betas": ("b1", "b2")}


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
    for kind, available in (("cuda", torch.cuda.is_available), ("mps", torch.backends.mps.is_available)):
        if device.type == kind and not available():
            raise ConfigError.single(
                "device",
                f"device={name!r} but {kind.upper()} is not available here",
                "use device=cpu or auto",
            )
    return device


def device(config: TrainerConfig) -> torch.device:
    """The run's device (:func:`resolve_device`), refused for fp16 off CUDA.

    Example:
        >>> device(TrainerConfig(max_steps=1, device="cpu"))
        device(type='cpu')
    """
    resolved = resolve_device(config.device)
    if config.mixed_precision == "fp16" and resolved.type != "cuda":
        raise ConfigError.single(
            "mixed_precision", f"fp16 needs a CUDA device, the run uses {resolved}", "use bf16 on the CPU"
        )
    return resolved


def schedule(config: TrainerConfig, total_steps: int) -> optim.Schedule | float:
    """The learning-rate schedule of ``config.scheduler`` over ``total_steps`` optimizer steps.

    Warm-up (``warmup_steps`` or ``warmup_ratio`` of the total) rises linearly from 0 to
    ``optimizer.lr`` and the named schedule (:data:`functrain.config.schedules.SCHEDULES`) takes over after
    it. Every count is in optimizer steps.

    Example:
        >>> cfg = TrainerConfig(max_steps=100, scheduler={"name": "cosine", "warmup_steps": 10})
        >>> round(float(schedule(cfg, 100)(10)), 6)
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
    args = dict(sc.args)
    try:
        main = SCHEDULES[sc.name](optim, lr, args, max(total_steps - warmup, 1), total_steps)
    except (TypeError, KeyError) as err:
        raise ConfigError.single(
            "scheduler.args",
            f"bad arguments for schedule {sc.name!r}: {err}",
            "check the schedule's arguments",
        ) from err
    if args:
        raise ConfigError.single(
            "scheduler.args", f"unused arguments {sorted(args)} for schedule {sc.name!r}", "remove them"
        )
    if not warmup:
        return main
    return optim.join_schedules(
        [optim.linear_schedule(0.0, lr, warmup), main],
        [warmup],  # join_schedules passes count - warmup
    )


def optimizer(
    config: TrainerConfig,
    learning_rate: Any,
    params: Mapping[str, torch.Tensor],
    frozen: set[str],
    noise_multiplier: float | None = None,
) -> optim.GradientTransformation:
    """The optimizer of ``config.optimizer``, with gradient clipping, frozen parameters and the weight
    average (``config.ema``); with DP-SGD (``config.dp_l2_norm_clip``), the private aggregate of the
    per-example gradients before all of it, its noise multiplier ``noise_multiplier``
    (:func:`dp_noise_multiplier`).

    ``optimizer.args`` take functrain's names or torch's (``betas: [0.9, 0.999]``).

    Example:
        >>> tx = optimizer(TrainerConfig(max_steps=10), 1e-3, {"w": torch.zeros(2)}, set())
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
        known = [p for p in inspect.signature(factory).parameters if p != "learning_rate"]
        raise ConfigError.single("optimizer.args", f"{err}", f"{oc.name} takes {known}") from err
    if frozen:
        tx = optim.freeze(tx, {name: name in frozen for name in params})
    if config.max_grad_norm is not None:
        tx = optim.chain(optim.clip_by_global_norm(config.max_grad_norm), tx)
    if config.dp_l2_norm_clip is not None:
        if noise_multiplier is None:
            raise ValueError(
                "optimizer: DP-SGD (dp_l2_norm_clip) needs its noise_multiplier (dp_noise_multiplier())"
            )
        tx = optim.chain(optim.differentially_private_aggregate(config.dp_l2_norm_clip, noise_multiplier), tx)
    return averaging.chain(config, tx)


def dp_noise_multiplier(config: TrainerConfig, dataset: Any, steps: int) -> float | None:
    """DP-SGD's noise multiplier: ``dp_noise_multiplier``, or the one Opacus's accountant finds for
    ``dp_target_epsilon`` at ``dp_delta`` over ``steps`` batches of ``batch_size`` from ``dataset``;
    ``None`` without DP-SGD.

    Example:
        >>> dp_noise_multiplier(TrainerConfig(max_steps=5, dp_l2_norm_clip=1.0, dp_noise_multiplier=1.1), [], 5)
        1.1
    """
    if config.dp_l2_norm_clip is None:
        return None
    if config.dp_noise_multiplier is not None:
        return config.dp_noise_multiplier
    examples = _length(
        dataset,
        "dp_target_epsilon",
        "needs the training set's length (the sampling rate is batch_size / examples)",
        "give a map-style dataset, or set dp_noise_multiplier",
    )
    try:
        return optim.privacy.noise_multiplier_for_epsilon(
            config.dp_target_epsilon, config.dp_delta, min(1.0, config.batch_size / max(examples, 1)), steps
        )
    except ImportError as err:
        raise ConfigError.single(
            "dp_target_epsilon", str(err), "install it, or set dp_noise_multiplier"
        ) from err


def criterion(config: TrainerConfig) -> Callable[[Any, Any], torch.Tensor]:
    """``config.criterion``: a ``torch.nn`` loss by name, or an import spec (``"pkg.module:Loss"``).

    Example:
        >>> criterion(TrainerConfig(max_steps=1, criterion="MSELoss"))
        MSELoss()
    """
    name, args = config.criterion.name, dict(config.criterion.args)
    if ":" in name:
        from functrain.config import resolve_object

        cls = resolve_object(name, path="criterion.name")
    else:
        cls = getattr(nn, name)
    return cls(**args) if isinstance(cls, type) else cls


def metrics(config: TrainerConfig) -> ftmetrics.Collection | None:
    """``config.metrics`` as a :class:`functrain.metrics.Collection` (``None`` without metrics).

    Example:
        >>> sorted(metrics(TrainerConfig(max_steps=1, metrics=["accuracy"])).metrics)
        ['accuracy']
    """
    if not config.metrics:
        return None
    built = {}
    for name, args in config.metrics.items():
        try:
            built[name] = ftmetrics.metric_from_spec({"name": name, **args})
        except (KeyError, ValueError, TypeError) as err:
            raise ConfigError.single(
                f"metrics.{name}", str(err), "see functrain.metrics.available_metrics()"
            ) from err
    return ftmetrics.Collection(built)


def frozen(config: TrainerConfig, model: nn.Module) -> set[str]:
    """The names of the trainable parameters ``config.freeze`` freezes.

    Example:
        >>> frozen(TrainerConfig(max_steps=1, freeze={"patterns": ["bias"]}), torch.nn.Linear(2, 1))
        {'bias'}
    """
    fc = config.freeze
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names: set[str] = set()
    if fc.patterns:
        mask = optim.mask_by_name(params, fc.patterns)
        names |= {k for k, v in mask.items() if v}
    if fc.module_indices:
        names |= set(optim.names_by_module_index(model, fc.module_indices))
    if fc.batchnorm:
        names |= set(optim.batchnorm_param_names(model))
    return names & set(params)


def _length(dataset: Any, field: str, problem: str, fix: str) -> int:
    """``len(dataset)``, or a ConfigError on ``field`` for a dataset without one (a stream)."""
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError.single(field, problem, fix) from None


def total_steps(config: TrainerConfig, dataset: Any) -> int:
    """The run's optimizer steps: ``max_steps``, or ``epochs`` over ``dataset`` (which must have a length).

    Example:
        >>> total_steps(TrainerConfig(epochs=2, batch_size=4), list(range(10)))
        6
    """
    if config.max_steps is not None:
        return config.max_steps
    n = _length(
        dataset,
        "epochs",
        "the train dataset has no length, so epochs cannot be counted",
        "set max_steps instead",
    )
    per_epoch = data.num_batches(
        n,
        config.batch_size * config.gradient_accumulation_steps,
        config.drop_last,
        max(1, distributed.world_size() // config.tensor_parallel),  # a tp group reads one slice
    )
    return per_epoch * config.epochs


def loader(
    config: TrainerConfig,
    dataset: Any,
    batch_size: int,
    *,
    key: torch.Tensor | None,
    device: torch.device,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pad_last: bool = False,
    pad_token_id: int = 0,
    ranks: tuple[int, int] | None = None,
) -> data.Loader:
    """A Loader over ``dataset`` with the config's data settings; ``key`` given: the training order
    (``shuffle``, ``drop_last``), else evaluation's (in order, every example). Each rank reads its slice
    (``ranks``: the ``(rank, world_size)`` slice, as :func:`functrain.distributed.data_ranks.data_ranks`
    says: a tensor-parallel group's ranks read one).
    ``shuffle: auto`` permutes a map-style dataset and reads a stream in its own order; ``shuffle: true``
    reads a stream through a shuffle buffer of ``shuffle_buffer_size`` examples. The batches of a
    ``collate_fn`` of one's own (which pads to each batch's longest sequence, as Hugging Face's do) are
    padded further to ``sequence_bucket`` lengths where they have an ``attention_mask``
    (:mod:`functrain.data.sequences`; the ``input_ids`` with ``pad_token_id``).

    Example:
        >>> len(loader(TrainerConfig(max_steps=1), list(range(10)), 4, key=None, device=torch.device("cpu")))
        3
    """
    train = key is not None
    if config.sequence_bucket is not None and collate_fn is not None:  # a collate of one's own pads to
        collate_fn = data.SequencePadding(collate_fn, config.sequence_bucket, pad_token_id)  # the longest
    options = {
        "drop_last": config.drop_last if train else False,
        "collate_fn": collate_fn,
        "num_workers": config.num_workers,
        "persistent_workers": config.persistent_workers,
        "prefetch_factor": config.prefetch_factor,
        "pin_memory": config.pin_memory,
        "device": device,
    }
    if pad_last:  # training's opt-in (pad_train_batches): a short last batch padded with a mask
        options["pad_last"] = True
    stream = data.is_stream(dataset)
    shuffle = train and (config.shuffle is True or (config.shuffle == "auto" and not stream))
    if shuffle and stream:
        options["shuffle_buffer"] = config.shuffle_buffer_size
    return data.as_loader(
        dataset, batch_size, key, "Trainer", shuffle=shuffle, shard=True, ranks=ranks, options=options
    )


def pads(config: TrainerConfig, kind: str, *, overridden: bool = False) -> bool:
    """Whether the ``kind`` step's batches are padded to the batch size (:mod:`functrain.data.padding`):
    the config says so (``pad_eval_batches``, ``pad_train_batches``; never in a sweep), and the step is the
    Trainer's own (``overridden``: a subclass's step gets its batches as they are).

    Example:
        >>> pads(TrainerConfig(max_steps=1), "eval"), pads(TrainerConfig(max_steps=1), "train")
        (True, False)
    """
    wanted = config.pad_train_batches if kind == "train" else config.pad_eval_batches
    return bool(wanted) and not config.sweep and not overridden


def sharding(config: TrainerConfig, model: nn.Module | None = None) -> distributed.Sharding | None:
    """``config.sharding`` as a :func:`functrain.distributed.fully_shard` request over every rank (one
    process: a world of one, which holds everything), or ``None`` (replicated; and with
    ``tensor_parallel > 1``, whose request over the mesh's dp axis :func:`tensor_parallel` makes). Call it
    after ``distributed.initialize()``. ``config.sharding_blocks`` names classes or submodules of ``model``
    (each name is checked against it when given).

    Example:
        >>> sharding(TrainerConfig(max_steps=1, sharding="full")).zero_stage
        3
    """
    if config.sharding == "none" or config.tensor_parallel > 1:
        return None
    blocks = "auto" if config.sharding_blocks == ["auto"] else config.sharding_blocks
    missing = unknown_block_names(model, blocks) if model is not None else []
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})  # type: ignore[union-attr]
        raise ConfigError.single(
            "sharding_blocks",
            f"{missing} name no class and no submodule of the model",
            f"give class names such as {classes[:6]} or submodule names, or 'auto'",
        )
    return distributed.fully_shard(level=config.sharding, blocks=blocks)


# the ready plans :func:`tensor_parallel_plan` tries, in order (functrain.distributed.tensor_parallel's names)
_READY_PLANS = ("GPT_PLAN", "GPT2_PLAN", "LLAMA_PLAN")


def tensor_parallel_plan(config: TrainerConfig, model: nn.Module) -> Plan:
    """``config.tensor_parallel_plan``, else the first ready plan (``GPT_PLAN``: nanoGPT-style names,
    ``GPT2_PLAN``: Hugging Face GPT-2, ``LLAMA_PLAN``: Hugging Face Llama) every entry of which names a
    submodule of ``model``; anything else is refused naming the field.

    Example:
        >>> tensor_parallel_plan(TrainerConfig(max_steps=1, tensor_parallel=2, save_strategy="no",
        ...                      tensor_parallel_plan={"0": "colwise"}), torch.nn.Sequential(torch.nn.Linear(2, 2)))
        {'0': 'colwise'}
    """
    if config.tensor_parallel_plan is not None:
        return dict(config.tensor_parallel_plan)
    names = [name for name, _ in model.named_modules() if name]
    for plan_name in _READY_PLANS:
        plan = getattr(distributed, plan_name)  # loaded on first use (DTensor's imports)
        if all(any(fnmatch.fnmatchcase(name, pattern) for name in names) for pattern in plan):
            return plan
    raise ConfigError.single(
        "tensor_parallel_plan",
        f"tensor_parallel={config.tensor_parallel} but no ready plan fits {type(model).__name__} (GPT_PLAN "
        f"splits *attn.q/k/v/proj and *mlp.fc/proj, GPT2_PLAN Hugging Face GPT-2's c_attn/c_fc/c_proj, LLAMA_PLAN "
        f"Hugging Face Llama's q/k/v/o_proj and gate/up/down_proj; its submodules are named like {names[:5]})",
        "give tensor_parallel_plan: {glob: colwise | rowwise | replicate} naming its linear layers (e.g. "
        "{'*attn.query': colwise, '*attn.out': rowwise}), or set tensor_parallel=1",
    )


def tensor_parallel(config: TrainerConfig, model: nn.Module, device: torch.device) -> TensorParallel | None:
    """``config.tensor_parallel`` as the step's strategy (:func:`functrain.distributed.tensor_parallel`)
    over a ``(dp, tp)`` mesh of ``world_size / N x N`` torchrun ranks (1-D when they are all one tp
    group and nothing is sharded), with :func:`tensor_parallel_plan`; ``None`` for ``tensor_parallel: 1``.
    ``config.sharding`` adds ZeRO over the mesh's dp axis (``fully_shard(mesh["dp"], level=...)``: each
    rank keeps ``1 / world_size`` of the optimizer state, and at ``params`` of the params). Collective
    (call it on every rank, after ``distributed.initialize()``). Refuses a world size ``N`` does not
    divide.

    Example:
        >>> tensor_parallel(TrainerConfig(max_steps=1), torch.nn.Linear(2, 1), torch.device("cpu")) is None
        True
    """
    n = config.tensor_parallel
    if n == 1:
        return None
    world = distributed.world_size()
    if not distributed.is_distributed() or world % n:
        raise ConfigError.single(
            "tensor_parallel",
            f"tensor_parallel={n} splits each layer over {n} torchrun ranks, but this run has {world} "
            f"process{'es' if world > 1 else ''}{'' if distributed.is_distributed() else ' (not under torchrun)'}",
            f"launch torchrun --nproc-per-node {n} (or a multiple of {n}: dp = world / {n}), or set "
            "tensor_parallel to a divisor of the world size",
        )
    plan = tensor_parallel_plan(config, model)
    from torch.distributed.device_mesh import init_device_mesh

    zero = config.sharding != "none"  # ZeRO shards over the dp axis, even one of a single rank
    shape, names = ((n,), ("tp",)) if world == n and not zero else ((world // n, n), ("dp", "tp"))
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    sharding = distributed.fully_shard(mesh["dp"], level=config.sharding) if zero else None
    try:
        return distributed.tensor_parallel(model, plan, mesh, sharding=sharding)
    except ValueError as err:  # the plan or the model cannot be split as asked: name the field
        field = "tensor_parallel_plan" if config.tensor_parallel_plan is not None else "tensor_parallel"
        raise ConfigError.single(
            field, str(err), "change the plan, the model or tensor_parallel as it says"
        ) from err


def initial_state(
    config: TrainerConfig,
    model: nn.Module,
    tx: optim.GradientTransformation,
    device: torch.device,
    sharding: distributed.Sharding | None = None,
    strategy: TensorParallel | None = None,
) -> tuple[TrainState, Any]:
    """The run's first state (``seed``, on ``device``, fp16's loss scale, ``init_weights_from``) and the
    report of what ``init_weights_from`` loaded (``None`` without it). With ``sharding`` the state is
    sharded as it is created: the optimizer state is built on the shards, never whole. With ``strategy``
    (:func:`tensor_parallel`) it is made whole, given its weights, then placed (collective): each rank
    keeps its parts (ZeRO over dp included), global rank 0's values.

    Example:
        >>> import functrain as ft
        >>> s, _ = initial_state(TrainerConfig(max_steps=1), torch.nn.Linear(2, 1), ft.optim.sgd(0.1), "cpu")
        >>> int(s.step)
        0
    """
    state = TrainState.create(
        model,
        tx,
        seed=config.seed,
        device=device,
        loss_scale=LossScale.create() if config.mixed_precision == "fp16" else None,
        sharding=sharding,
    )
    place = strategy.place if strategy is not None else lambda whole: whole
    if not config.init_weights_from:
        return place(state), None
    layout = state.layout
    whole = state if layout is None else state.replace(params=layout.full_params(state.params))
    whole, report = checkpoint.init_weights_from(
        config.init_weights_from, whole, tied_parameters=dict(state.tied)
    )
    if not report.loaded:
        raise ConfigError.single(
            "init_weights_from",
            f"no weight of {config.init_weights_from} matches the model by name and shape",
            "check the file and the model",
        )
    if layout is not None and layout.request.shards_params:  # the loaded weights cut to this rank's rows
        whole = whole.replace(
            params={n: local_rows(p, layout.request).clone() for n, p in whole.params.items()}
        )
    return place(whole), report


class Losses(NamedTuple):
    """The Trainer's loss functions of ``(model, batch)``: training's (augmented), evaluation's, and the
    prediction's forward."""

    train: Callable[[Callable[..., Any], Any], Any]
    eval: Callable[[Callable[..., Any], Any], Any]
    predict: Callable[[Callable[..., Any], Any], Any]


def replicated(state: TrainState, model: nn.Module, device: torch.device) -> tuple[TrainState, Any]:
    """Under torchrun: ``state`` made the same on every rank (rank 0's) and the gradient reducer that
    averages gradients in the step; else ``(state, None)``."""
    if not distributed.is_distributed():
        return state, None
    return distributed.replicate(state, device=device), distributed.gradient_reducer(model=model)


def steps(
    config: TrainerConfig,
    model: nn.Module,
    losses: Losses,
    metrics: ftmetrics.Collection | None,
    reducer: Any = None,
    sharding: distributed.Sharding | None = None,
    strategy: TensorParallel | None = None,
) -> tuple[Step, Step, Step]:
    """The pure train, eval and predict steps (:class:`functrain.step.Step`) of ``config`` (precision, accumulation, frozen BatchNorm,
    skipping non-finite steps, a sweep's ensemble) over ``losses``; ``reducer``: torchrun's gradient
    averaging; ``sharding``: the state's (:func:`sharding`), which the train step reduce-scatters for
    (evaluation and prediction gather a ZeRO-3 state's params inside their steps); ``strategy``: tensor
    parallelism's (:func:`tensor_parallel`), instead of both.

    Example:
        >>> import functrain as ft
        >>> mse = lambda m, batch: torch.nn.functional.mse_loss(m(batch[0]), batch[1])
        >>> train, _, _ = steps(TrainerConfig(max_steps=1), torch.nn.Linear(2, 1), Losses(mse, mse, mse), None)
    """
    precision = None if config.mixed_precision == "no" else config.mixed_precision
    train = make_train_step(
        model,
        losses.train,
        accumulate=config.gradient_accumulation_steps,
        precision=precision,
        metrics=None,
        freeze_batchnorm=config.freeze.batchnorm,
        gradient_reducer=reducer,
        sharding=sharding,
        strategy=strategy,
        per_example=config.dp_l2_norm_clip is not None,
        sam_rho=config.sam_rho,
    )
    if config.nonfinite != "ignore":  # inside the ensemble's vmap below: each member skips on its own
        train = cbs.skip_nonfinite(train)
    evaluate = make_eval_step(model, losses.eval, metrics=metrics, precision=precision)
    predict = make_predict_step(model, losses.predict, precision=precision)
    if config.sweep:
        return ensemble.step(train), ensemble.eval_step(evaluate), ensemble.predict_step(predict)
    return train, evaluate, predict


def compiled(
    config: TrainerConfig, kind: str, fn: Step, rows: int | None = None, background: Any = None
) -> CompiledStep | TieredStep:
    """``fn`` (the ``kind`` ``"train"``/``"eval"``/``"predict"`` step) under :func:`functrain.jit` as the
    config asks: compiled, eager or tiered (``compile: auto``: eager first, compiled where it pays;
    :func:`functrain.compile.tiers.tiered`), donated (training), and torch's portable compile cache in the
    run directory (opt-in: its files are pickles). Compiled (``compile: true``, or ``auto`` once on the
    inductor tier), in one process, the train step runs a short last batch eagerly (:class:`~functrain.trainer.short_batch.EagerShortBatches`): one
    compile, exact, BatchNorm included, for any dataset length (``rows``: a full batch's,
    :func:`batch_rows`). ``background``: the tiered train step's
    :class:`~functrain.compile.background.BackgroundBuild` (:mod:`functrain.trainer.background`)."""
    cache_dir = Path(config.output_dir) / COMPILE_CACHE_DIR if config.compile_cache else None
    options = dict(
        mode=config.compile_mode,
        donate=config.donate and kind == "train",
        dynamic=config.compile_dynamic if kind == "train" else (config.compile_dynamic or None),
        cache_dir=cache_dir,
    )
    short_eager = kind == "train" and rows is not None and not distributed.is_distributed()
    if config.compile == "auto":
        return tiered(fn, rows=rows if short_eager else None, background=background, **options)
    if config.compile is True and short_eager:
        from functrain.trainer.short_batch import EagerShortBatches  # imports dynamo: only where it compiles

        return EagerShortBatches(fn, rows=rows, **options)
    from functrain.jit import jit  # dynamo's import (seconds) only where a step compiles

    return jit(fn, compile=config.compile, **options)


def batch_rows(config: TrainerConfig, dataset: Any) -> int | None:
    """The examples of a full training batch of ``dataset``: a ``DataLoader``'s own batch size, else
    ``batch_size * gradient_accumulation_steps``, at most the dataset's length (``None``: unknown).

    Example:
        >>> batch_rows(TrainerConfig(max_steps=1, batch_size=4), list(range(3)))
        3
    """
    if isinstance(dataset, torch.utils.data.DataLoader):
        return dataset.batch_size
    rows = config.batch_size * config.gradient_accumulation_steps
    try:
        return max(1, min(rows, len(dataset)))
    except TypeError:  # a stream without a length
        return rows


# eval_strategy/save_strategy -> fit's eval_every/save_every, given eval_steps/save_steps ("auto" is
# "epoch" where it gets here: the Trainer has resolved it to "no" for a run without an eval set)
_EVERY: dict[str, Callable[[int | None], int | str | None]] = {
    "no": lambda steps: None,
    "auto": lambda steps: "epoch",
    "epoch": lambda steps: "epoch",
    "steps": lambda steps: steps,
}


def every(config: TrainerConfig) -> dict[str, int | str | None]:
    """``fit``'s ``eval_every``, ``save_every``, ``save_final`` and ``log_steps`` from the config's
    strategies (``save_strategy: no`` saves no final state either).

    Example:
        >>> every(TrainerConfig(max_steps=10, eval_strategy="steps", eval_steps=5, log_steps=2))
        {'eval_every': 5, 'save_every': 'epoch', 'save_final': True, 'log_steps': 2}
    """
    return {
        "eval_every": _EVERY[config.eval_strategy](config.eval_steps),
        "save_every": _EVERY[config.save_strategy](config.save_steps),
        "save_final": config.save_strategy != "no",
        "log_steps": config.log_steps,
    }


def best_metric(config: TrainerConfig) -> str:
    """The logged name of ``metric_for_best_model``: ``"eval/<name>"``.

    Example:
        >>> best_metric(TrainerConfig(max_steps=1))
        'eval/loss'
    """
    return f"eval/{config.metric_for_best_model}"


def manager(
    config: TrainerConfig, request: distributed.Sharding | None = None
) -> checkpoint.CheckpointManager | ShardedCheckpointManager:
    """The run's checkpoint folder: retention, and the best model by ``metric_for_best_model`` when the run
    evaluates. Opening it reads only. With ``config.sharding`` a :class:`ShardedCheckpointManager` (one
    file per rank and a manifest, restored on any world size) over ``request`` (default:
    :func:`sharding` of the config); not with ``tensor_parallel > 1``, whose state is saved gathered whole
    (one ordinary file, placed again on restore, on any layout).

    Example:
        >>> manager(TrainerConfig(output_dir="runs/a", max_steps=1)).latest()  # doctest: +SKIP
    """
    evaluates = config.eval_strategy != "no"
    retention: dict[str, Any] = {
        "max_to_keep": config.save_total_limit,
        "best_metric": best_metric(config) if evaluates else None,
        "best_mode": config.resolved_best_model_mode or "min",
        "keep_best": 1 if evaluates else 0,
    }
    directory = Path(config.output_dir) / config.checkpoints_dir
    if config.sharding != "none" and config.tensor_parallel == 1:
        return ShardedCheckpointManager(directory, request or sharding(config), **retention)
    return checkpoint.CheckpointManager(directory, **retention)


def callbacks(config: TrainerConfig, extra: Iterable[cbs.Callback] = ()) -> list[cbs.Callback]:
    """The callbacks the config asks for (monitors, early stopping, printing, averaged evaluation, skipped
    steps), then ``extra``.

    Example:
        >>> [type(c).__name__ for c in callbacks(TrainerConfig(max_steps=1))]
        ['LearningRateMonitor', 'Timer', 'Preemption', 'SkippedSteps']
    """
    out: list[cbs.Callback] = [cbs.LearningRateMonitor(), cbs.Timer(), cbs.Preemption()]
    if config.early_stopping is not None:
        es = config.early_stopping
        out.append(
            cbs.EarlyStopping(
                f"eval/{es.monitor}",
                mode=es.resolved_mode or "min",
                patience=es.patience,
                min_delta=es.min_delta,
            )
        )
    if config.print_steps:
        out.append(cbs.PrintMetrics(every=config.print_steps))
    out += averaging.callbacks(config)
    if config.nonfinite != "ignore":
        stop = config.nonfinite == "stop"
        every = 1 if stop else config.resolved_max_consecutive_nonfinite
        out.append(cbs.SkippedSteps(every, every_step=stop))
    return out + list(extra)


# name -> (whether the config turns it on, the writer over the run's logs folder). Adding a logger is one
# entry here (a ``report_to`` service also adds its name to that field's list, checked below).
LOGGERS: dict[str, tuple[Callable[[TrainerConfig], bool], Callable[[TrainerConfig, Path], Any]]] = {
    "jsonl": (lambda c: c.jsonl, lambda c, d: ftlog.JSONLWriter(d)),
    "csv": (lambda c: c.csv, lambda c, d: ftlog.CSVWriter(d)),
    "tensorboard": (lambda c: c.tensorboard, lambda c, d: ftlog.TensorBoardWriter(d / "tensorboard")),
    "wandb": (
        lambda c: "wandb" in c.report_to,
        lambda c, d: ftlog.WandbWriter(d, name=Path(c.output_dir).name, config=c.to_dict()),
    ),
    "mlflow": (
        lambda c: "mlflow" in c.report_to,
        lambda c, d: ftlog.MLflowWriter(d, run_name=Path(c.output_dir).name),
    ),
}
_SERVICES = get_args(get_args(type_hints(TrainerConfig)["report_to"])[0])
if not set(_SERVICES) <= set(LOGGERS):  # pragma: no cover - a name in report_to with no writer
    raise ImportError(f"functrain.trainer.build.LOGGERS has no writer for report_to {sorted(_SERVICES)}")


def loggers(config: TrainerConfig, log_dir: Path) -> list[Any]:
    """The writers the config turns on, over ``log_dir`` (none on ranks other than 0).

    Example:
        >>> [type(w).__name__ for w in loggers(TrainerConfig(max_steps=1), Path("runs/a/logs"))]  # doctest: +SKIP
        ['JSONLWriter']
    """
    if distributed.rank() != 0:
        return []
    return [make(config, log_dir) for on, make in LOGGERS.values() if on(config)]
