"""`TrainerConfig`: every setting of a ``Trainer`` run, typed, checked as a whole, saved as YAML.

Every field is consumed by the Trainer: none is accepted and then ignored. Settings that only matter
together with another one are refused when that other one makes them meaningless (``eval_steps``
without ``eval_strategy="steps"``, ``compile_mode`` with ``compile=false``, ...), so a config that
loads is a config that does what it says.

Counting: ``max_steps``, ``eval_steps``, ``save_steps``, ``log_steps``, ``print_steps`` and the
scheduler's warm-up count *optimizer* steps (one update, i.e. ``gradient_accumulation_steps``
batches), never samples.

Example:
    >>> config = TrainerConfig(epochs=3, optimizer={"lr": "3e-4"}, metrics=["accuracy"])
    >>> config.optimizer.lr, config.metrics
    (0.0003, {'accuracy': {}})
    >>> config.with_overrides(["scheduler=warmup_cosine", "scheduler.warmup_ratio=0.1"]).scheduler.name
    'warmup_cosine'
    >>> TrainerConfig.from_yaml(config.to_yaml()) == config
    True
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from functrain.config.coerce import plain_data
from functrain.config.errors import ConfigError, Problem, suggestion
from functrain.config.imports import ImportSpec, check_import_spec, imports_deferred, normalize_import_spec
from functrain.config.names import metric_mode
from functrain.config.overrides import apply_well_formed_overrides
from functrain.config.section import ConfigSection, config_section, option, rule
from functrain.config.sections import (
    CriterionConfig,
    EarlyStoppingConfig,
    EmaConfig,
    FreezeConfig,
    OptimizerConfig,
    SchedulerConfig,
)
from functrain.config.sweep import normalize_sweep
from functrain.config.yaml_io import (
    dump_yaml,
    load_yaml_mapping_with_lines,
    read_yaml_source,
    write_text_atomic,
)

__all__ = ["TrainerConfig"]

Strategy = Literal["no", "steps", "epoch"]
# eval_strategy's own choices: "auto" evaluates every epoch when the run has an eval set, else never
EvalStrategy = Literal["auto", "no", "steps", "epoch"]
ShardingLevel = Literal["none", "optimizer", "grads", "params"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _normalize_metrics(value: Any, path: str) -> Any:
    """Metric names as ``{name: {args}}``: from a name, a list of names / ``{name: args}``, or a mapping."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        out: dict[str, Any] = {}
        for i, item in enumerate(value):
            if isinstance(item, Mapping) and len(item) == 1:
                ((name, args),) = item.items()
            elif isinstance(item, str):
                name, args = item, {}
            else:
                raise ConfigError.single(
                    f"{path}[{i}]",
                    f"expected a metric name or {{name: {{args}}}}, got {item!r}",
                    "write e.g. accuracy",
                )
            if name in out:
                raise ConfigError.single(
                    f"{path}[{i}]", f"metric {name!r} is listed twice", "keep one of them"
                )
            out[name] = args
        value = out
    if not isinstance(value, Mapping):
        raise ConfigError.single(
            path,
            f"expected metric names, got {type(value).__name__} {value!r}",
            "write e.g. metrics=[accuracy, f1]",
        )
    problems = []
    result: dict[str, dict[str, Any]] = {}
    for name, args in value.items():
        if not isinstance(name, str) or not name.strip():
            problems.append(
                Problem(path, f"metric name {name!r} is not a non-empty string", "write e.g. accuracy")
            )
            continue
        if name == "loss":
            problems.append(
                Problem(f"{path}.loss", "the loss is always evaluated", "remove 'loss' from metrics")
            )
            continue
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            problems.append(
                Problem(f"{path}.{name}", f"arguments must be a mapping, got {args!r}", "write {}")
            )
            continue
        result[name] = plain_data(args, f"{path}.{name}")
    if problems:
        raise ConfigError(problems)
    return result


def _normalize_spec(value: Any, path: str) -> Any:
    if value is None:
        return None
    spec = normalize_import_spec(value, path)
    if not imports_deferred():
        check_import_spec(spec, path)
    return spec


# Other trainers' names for the sharding levels -> functrain's (the ``sharding`` field's doc lists them):
# FSDP's ShardingStrategy and DeepSpeed's ZeRO stage numbers.
SHARDING_ALIASES: dict[Any, str] = {
    "no_shard": "none",
    "shard_grad_op": "grads",
    "grad_op": "grads",
    "full_shard": "params",
    "full": "params",
    0: "none",
    1: "optimizer",
    2: "grads",
    3: "params",
}


def _block_names(value: Any, path: str) -> Any:
    """``sharding_blocks``: ``"auto"`` kept as the list ``["auto"]``'s shorthand, one name as a list."""
    if isinstance(value, str):
        return [value]
    return value


def _sharding_level(value: Any, path: str) -> Any:
    """``sharding`` in functrain's spelling: FSDP's and DeepSpeed's names mapped, ``false``/``null`` off."""
    if value is False or value is None:
        return "none"
    if isinstance(value, bool):  # true names no level (and would equal the int 1 below)
        return value
    if isinstance(value, int):
        return SHARDING_ALIASES.get(value, value)
    if not isinstance(value, str):
        return value
    lowered = value.lower()
    return SHARDING_ALIASES.get(lowered, lowered if lowered in get_args(ShardingLevel) else value)


def _tp_plan(value: Any, path: str) -> Any:
    """``tensor_parallel_plan``: a mapping of non-empty names or globs to one of the plan's styles."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ConfigError.single(
            path,
            f"expected a mapping of submodule globs to styles, got {value!r}",
            "write e.g. {'*attn.q': colwise}",
        )
    styles = ("colwise", "rowwise", "replicate")
    problems = [
        Problem(
            f"{path}.{name}",
            f"style {style!r} is not one of {list(styles)}",
            "use colwise, rowwise or replicate",
        )
        for name, style in value.items()
        if style not in styles
    ]
    problems += [
        Problem(path, f"{name!r} is not a submodule name or glob", "write e.g. '*attn.q'")
        for name in value
        if not isinstance(name, str) or not name.strip()
    ]
    if problems:
        raise ConfigError(problems)
    return dict(value)


def _false_is_off(value: Any, path: str) -> Any:
    """An optional section (early_stopping, ema) written as ``false`` is off, as ``null`` is."""
    return None if value is False else value


@config_section("")
class TrainerConfig(ConfigSection):
    """Everything a ``Trainer`` run is configured with; built from keywords, a mapping or YAML.

    Invalid settings raise one :class:`~functrain.config.ConfigError` listing every problem with its
    field path and a fix. The config is frozen; ``replace`` and ``with_overrides`` return new ones.

    Example:
        >>> config = TrainerConfig(output_dir="runs/mlp", max_steps=1000, batch_size=64, eval_strategy="steps",
        ...                        eval_steps=100, early_stopping={"monitor": "loss", "patience": 5})
        >>> config.early_stopping.patience, config.resolved_eval_batch_size
        (5, 64)
    """

    # -- run
    output_dir: str = option("outputs", doc="Run directory: checkpoints, logs and the resolved config.yaml.")
    overwrite_output_dir: bool = option(
        False,
        doc="Replace the run output_dir holds (its checkpoints and logs). Without it (and without "
        "resume_from_checkpoint) a new run in an output_dir that holds one writes the first free "
        "<output_dir>-N beside it, and says so.",
    )
    seed: int = option(42, doc="Seed of the run's random key (init, shuffling, dropout).", minimum=0)
    # -- duration
    epochs: int | None = option(None, doc="Passes over train_dataset; set this or max_steps.", minimum=1)
    max_steps: int | None = option(None, doc="Optimizer steps to train for; set this or epochs.", minimum=1)
    # -- data
    batch_size: int = option(
        32, doc="Training samples per batch (per micro-batch with accumulation).", minimum=1
    )
    eval_batch_size: int | None = option(None, doc="Evaluation batch size; null uses batch_size.", minimum=1)
    shuffle: bool | Literal["auto"] = option(
        "auto",
        doc="Reshuffle the training data each epoch. 'auto': a map-style dataset gets a new permutation each "
        "epoch, a stream (IterableDataset, HF streaming) is read in its own order; true also shuffles a "
        "stream, through a buffer of shuffle_buffer_size examples.",
    )
    shuffle_buffer_size: int = option(
        1000,
        doc="Examples in the seeded buffer that shuffles a stream (with shuffle: true); more mix further.",
        minimum=1,
    )
    drop_last: bool = option(False, doc="Drop the last incomplete training batch of each epoch.")
    pad_eval_batches: bool = option(
        True, doc="Pad a short evaluation/prediction batch to the batch size, masked: one compile."
    )
    pad_train_batches: bool = option(
        False,
        doc="Pad the short last training batch, masked (weight zero): no recompile for it. Exact for "
        "Hugging Face labels or models without dropout; refused with BatchNorm (use drop_last). Off, the "
        "compiled train step runs that batch eagerly (exact, no recompile).",
    )
    sequence_bucket: int | None = option(
        16,
        doc="Pad the sequence axis of batches with an attention_mask (Hugging Face's layout) to the smallest "
        "sequence_bucket * 2**k that holds their longest sequence, masked: one compile per bucket (at most 6 "
        "up to 512 tokens) where lengths as the collate pads them compile once each; null: as they come.",
        minimum=1,
    )
    num_workers: int = option(0, doc="DataLoader worker processes (0 loads in the main process).", minimum=0)
    persistent_workers: bool = option(
        True, doc="Keep the worker processes from one epoch to the next (with num_workers > 0)."
    )
    prefetch_factor: int | None = option(
        None, doc="Batches each worker loads ahead; null: torch's 2. Needs num_workers > 0.", minimum=1
    )
    pin_memory: bool = option(False, doc="Pin host batches in page-locked memory for faster GPU copies.")
    # -- optimization
    optimizer: OptimizerConfig = option(default_factory=OptimizerConfig, doc="The optimizer.")
    scheduler: SchedulerConfig = option(default_factory=SchedulerConfig, doc="The learning-rate schedule.")
    criterion: CriterionConfig = option(
        default_factory=CriterionConfig,
        doc="The criterion(preds, target) for (inputs, target) batches.",
    )
    gradient_accumulation_steps: int = option(
        1, doc="Batches whose gradients make one optimizer step.", minimum=1
    )
    max_grad_norm: float | None = option(
        None, doc="Clip gradients to this global norm before each update; null: no clipping.", greater_than=0
    )
    nonfinite: Literal["skip", "stop", "ignore"] = option(
        "skip",
        doc="A training step whose loss or gradients are NaN/inf: 'skip' its update (weights, buffers and "
        "optimizer state stay as they were; logged as train/skipped_steps), 'stop' the run with an error at "
        "that step (one host sync per step), or 'ignore' it (the update is applied: NaN spreads to every weight).",
    )
    max_consecutive_nonfinite: int | None = option(
        None,
        doc="With nonfinite=skip: end the run with an error once this many steps in a row were skipped "
        "(checked when training scalars are logged); null: 10.",
        minimum=1,
    )
    # -- transforms of the step: DP-SGD, SAM
    dp_l2_norm_clip: float | None = option(
        None,
        doc="DP-SGD: clip each example's gradient to this L2 norm, add Gaussian noise, average "
        "(ft.optim.differentially_private_aggregate before the optimizer; per-example gradients in the step). "
        "Needs dp_noise_multiplier or dp_target_epsilon; null: off. The noise is seeded from the operating "
        "system (secret), not from seed; a resume continues it exactly.",
        greater_than=0,
    )
    dp_noise_multiplier: float | None = option(
        None, doc="DP-SGD: the noise's standard deviation over dp_l2_norm_clip.", minimum=0
    )
    dp_target_epsilon: float | None = option(
        None,
        doc="DP-SGD: the epsilon the whole run may spend at dp_delta; the noise multiplier is found by "
        "Opacus's RDP accountant (pip install functrain[privacy]) from batch_size / the training set's "
        "length and the run's steps. Instead of dp_noise_multiplier.",
        greater_than=0,
    )
    dp_delta: float = option(
        1e-5,
        doc="DP-SGD: the delta of dp_target_epsilon (keep it below 1 / training examples).",
        greater_than=0,
        less_than=1,
    )
    sam_rho: float | None = option(
        None,
        doc="Sharpness-aware minimization: apply the gradient taken at params + sam_rho * g / ||g|| (two "
        "forward and backward passes per step, one graph); null: off.",
        greater_than=0,
    )
    # -- evaluation
    metrics: dict[str, dict[str, Any]] = option(
        default_factory=dict,
        doc="Metrics by name, as a list [accuracy, f1] or a mapping {name: {args}}; loss is always computed.",
        normalize=_normalize_metrics,
    )
    eval_strategy: EvalStrategy = option(
        "auto",
        doc="When to evaluate: 'auto' (every epoch when there is an eval set, eval_dataset; else never), "
        "'epoch', every eval_steps ('steps'), or 'no'. 'epoch' and 'steps' need an eval set.",
    )
    eval_steps: int | None = option(
        None, doc="Optimizer steps between evaluations (eval_strategy=steps).", minimum=1
    )
    metric_for_best_model: str = option(
        "loss", doc="Evaluation result that ranks checkpoints: 'loss' or a name from metrics."
    )
    best_model_mode: Literal["min", "max"] | None = option(
        None, doc="Whether lower ('min') or higher ('max') metric_for_best_model is better; null infers it."
    )
    load_best_model_at_end: bool = option(False, doc="After training, restore the best evaluated checkpoint.")
    early_stopping: EarlyStoppingConfig | None = option(
        None,
        doc="Stop when an evaluation result stops improving; null: off.",
        normalize=_false_is_off,
    )
    # -- checkpoints
    save_strategy: Strategy = option(
        "epoch",
        doc="When to checkpoint: 'epoch', every save_steps ('steps'), or 'no'. The final state is saved "
        "too, except with 'no': then only a run stopped by SIGTERM/SIGINT saves one (to resume from).",
    )
    save_steps: int | None = option(
        None, doc="Optimizer steps between checkpoints (save_strategy=steps).", minimum=1
    )
    save_total_limit: int | None = option(
        3,
        doc="Checkpoints to keep: the newest N; with evaluation the best by metric_for_best_model is kept "
        "too, beyond these (load_best_model_at_end always finds it); null keeps all.",
        minimum=1,
    )
    checkpoints_dir: str = option("checkpoints", doc="Checkpoint folder, relative to output_dir.")
    init_weights_from: str | None = option(
        None, doc="Checkpoint or weights file to initialize the model from (weights only, not the run)."
    )
    resume_from_checkpoint: bool | str = option(
        False,
        doc="true: resume the run in output_dir from its latest checkpoint (fresh start if none); a path: "
        "that checkpoint. functrain train --resume RUN_DIR sets it, with RUN_DIR's saved config.",
    )
    # -- logging
    log_steps: int = option(10, doc="Optimizer steps between logged training scalars.", minimum=1)
    logs_dir: str = option("logs", doc="Log folder, relative to output_dir.")
    tensorboard: bool = option(False, doc="Write TensorBoard event files to logs_dir.")
    csv: bool = option(False, doc="Write logged scalars to logs_dir/metrics.csv.")
    jsonl: bool = option(
        True, doc="Write logged scalars to logs_dir/metrics.jsonl, one JSON object per line."
    )
    report_to: list[Literal["wandb", "mlflow"]] = option(
        default_factory=list,
        doc="Also log to these services: 'wandb' (Weights & Biases), 'mlflow' (optional extras, configured "
        "by their environment variables, e.g. WANDB_PROJECT, MLFLOW_TRACKING_URI).",
    )
    print_summary: bool = option(
        True,
        doc="Print a model summary (params per module, trainable/frozen, dtype, bytes) when training starts.",
    )
    progress_bar: bool = option(True, doc="Show a progress bar on the console.")
    print_steps: int | None = option(
        None, doc="Also print a line of training scalars every this many optimizer steps.", minimum=1
    )
    # -- hardware and compilation
    device: str = option(
        "auto", doc="'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:N' or 'mps'."
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = option(
        "no", doc="Autocast dtype: 'no', 'bf16', or 'fp16' (with loss scaling; needs a GPU)."
    )
    compile: bool | Literal["auto"] = option(
        "auto",
        doc="'auto': start on the eager step and compile (torch.compile, one graph) only where the run is "
        "long enough for it to pay (functrain.compile.tiers); true: always compile, waiting for it; false: "
        "always eager.",
    )
    compile_background: bool | Literal["auto"] = option(
        "auto",
        doc="With compile: auto, compile the train and eval steps in a low-priority child process while the "
        "run goes on eagerly, then switch where the warm compile pays (functrain.compile.background). Only "
        "for runs the config rebuilds (model and train_dataset import specs, a plain Trainer). 'auto': where "
        "cores are idle (the cores less torch's threads and the load; one host thread on a GPU); true/false: "
        "always/never.",
    )
    compile_mode: CompileMode | None = option(None, doc="torch.compile mode; null: PyTorch's default.")
    compile_dynamic: bool | None = option(
        False,
        doc="torch.compile's dynamic for the train step: false compiles each batch shape it meets (the "
        "fastest kernels; sequence_bucket keeps the shapes few), null makes a size symbolic once it "
        "changes, true from the first compile. Evaluation: null unless this is true.",
    )
    donate: bool = option(False, doc="Let the step overwrite the incoming state's tensors (saves memory).")
    compile_cache: bool = option(
        False,
        doc="Keep torch's portable compile cache in output_dir/compile-cache, so that a run resumed on "
        "another machine of the same kind starts warm. Its files are torch's pickles (loading one can run "
        "code): turn it on only for run directories that only you write. Off, a new process on the same "
        "machine still starts warm from torch's local cache.",
    )
    # -- distributed (torchrun)
    sharding: ShardingLevel = option(
        "none",
        doc="Shard the training state over the torchrun ranks (ZeRO): 'none' replicates it (data "
        "parallel); 'optimizer' shards the optimizer state (ZeRO-1), 'grads' the gradients too (ZeRO-2), "
        "'params' the params too (ZeRO-3). Aliases: FSDP's full_shard/full = params, shard_grad_op/grad_op "
        "= grads, no_shard = none; DeepSpeed's stages 0-3. Checkpoints are then one file per rank (any "
        "world size resumes them). With tensor_parallel: over the mesh's dp axis (each rank keeps "
        "1/world_size of what it shards), checkpoints saved whole. Not with sweep or fp16.",
        normalize=_sharding_level,
    )
    sharding_blocks: list[str] | None = option(
        None,
        doc="With sharding=params: the repeated blocks (a transformer's layers) whose params are gathered "
        "inside their own forward and again in their recomputed backward, so the step holds one block's "
        "whole params at a time (ZeRO-3's memory, for one more forward per block): 'auto' (the entries of "
        "every nn.ModuleList of 2+ modules of one class), or class names and submodule names (as HF's "
        "transformer_layer_cls_to_wrap). null: the step gathers the whole model.",
        normalize=_block_names,
    )
    tensor_parallel: int = option(
        1,
        doc="Split each layer's matmuls over this many torchrun ranks (tensor parallelism, DTensor params): a "
        "(dp, tp) mesh of world_size/N x N, each dp group reading its own slice of the data and its N ranks "
        "the same batch. The plan: tensor_parallel_plan, else the first of functrain.distributed's GPT_PLAN "
        "(nanoGPT-style attn.q/k/v/proj, mlp.fc/proj), GPT2_PLAN (Hugging Face GPT-2), LLAMA_PLAN (Hugging Face "
        "Llama) whose every entry names layers of the model. With sharding: ZeRO over the dp axis (not "
        "sharding_blocks). 1: off. Not with sweep, fp16, DP-SGD or SAM yet.",
        minimum=1,
    )
    tensor_parallel_plan: dict[str, Literal["colwise", "rowwise", "replicate"]] | None = option(
        None,
        doc="With tensor_parallel > 1: submodule names or globs -> 'colwise', 'rowwise' or 'replicate' "
        "(functrain.distributed.tensor_parallel's plan), e.g. {'*attn.q': colwise, '*attn.proj': rowwise}; "
        "null: a ready plan chosen for the model.",
        normalize=_tp_plan,
    )
    tensor_parallel_check_batches: Literal["first", "every"] = option(
        "first",
        doc="With tensor_parallel > 1: compare a digest of the batch over each tp group (one small "
        "collective; an error names the ranks) on the first step of a run, or on every step (debugging: "
        "each batch is read back to the host).",
    )
    # -- sweeps (functrain.ensemble)
    sweep: dict[str, list[Any]] = option(
        default_factory=dict,
        doc="Values to train side by side as one ensemble, e.g. {optimizer.lr: [1e-3, 3e-3], seed: [0, 1]}: "
        "every combination is a member; only optimizer.lr, optimizer.weight_decay and seed can be swept.",
        normalize=lambda value, path: normalize_sweep(value, path, TrainerConfig),
    )
    # -- freezing, weight averaging
    freeze: FreezeConfig = option(default_factory=FreezeConfig, doc="Parameters not to train.")
    ema: EmaConfig | None = option(
        None,
        doc="Keep an exponential moving average of the weights; null: off.",
        normalize=_false_is_off,
    )
    # -- objects for config-file driven runs (import specs, see functrain.config.imports)
    model: ImportSpec | None = option(
        None, doc="Import spec of the model (or its factory).", normalize=_normalize_spec
    )
    train_dataset: ImportSpec | None = option(
        None, doc="Import spec of the training dataset.", normalize=_normalize_spec
    )
    eval_dataset: ImportSpec | None = option(
        None, doc="Import spec of the evaluation dataset.", normalize=_normalize_spec
    )
    test_dataset: ImportSpec | None = option(
        None, doc="Import spec of the dataset tested after training.", normalize=_normalize_spec
    )

    # ------------------------------------------------------------------------------------------ derived

    @property
    def resolved_eval_batch_size(self) -> int:
        """``eval_batch_size``, or ``batch_size`` when it is null."""
        return self.eval_batch_size if self.eval_batch_size is not None else self.batch_size

    @property
    def evaluates_every(self) -> Literal["no", "steps", "epoch"]:
        """``eval_strategy`` where the run has an eval set (``"auto"`` is ``"epoch"`` there).

        Example:
            >>> TrainerConfig(max_steps=1).evaluates_every
            'epoch'
        """
        return "epoch" if self.eval_strategy == "auto" else self.eval_strategy

    @property
    def resolved_max_consecutive_nonfinite(self) -> int:
        """``max_consecutive_nonfinite``, or 10 when it is null."""
        return self.max_consecutive_nonfinite if self.max_consecutive_nonfinite is not None else 10

    @property
    def resolved_best_model_mode(self) -> Literal["min", "max"]:
        """``best_model_mode``, or the direction inferred from ``metric_for_best_model``."""
        mode = self.best_model_mode or metric_mode(self.metric_for_best_model)
        if mode is None:
            raise ConfigError([_unknown_direction("best_model_mode", self.metric_for_best_model)])
        return mode

    # ------------------------------------------------------------------------------------------ I/O

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> TrainerConfig:
        """Load from a YAML file path or YAML text (see :func:`~functrain.config.yaml_io.read_yaml_source`).

        Example:
            >>> TrainerConfig.from_yaml("epochs: 2\\neval_strategy: no").eval_strategy
            'no'
        """
        text, where = read_yaml_source(source)
        data, lines = load_yaml_mapping_with_lines(text, where)
        try:
            return cls.from_dict(data)
        except ConfigError as err:
            err.in_source(where, lines)  # the file and the line of each field in the message
            raise

    def to_yaml(self) -> str:
        """The full config as YAML text, every field included, that ``from_yaml`` loads back equal."""
        return dump_yaml(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_yaml()`` to ``path`` atomically (parent folders are created); returns the path.

        Example:
            >>> import tempfile, pathlib
            >>> config = TrainerConfig(epochs=1)
            >>> TrainerConfig.from_yaml(config.save(pathlib.Path(tempfile.mkdtemp()) / "config.yaml")) == config
            True
        """
        return write_text_atomic(path, self.to_yaml())

    def with_overrides(self, overrides: Sequence[str]) -> TrainerConfig:
        """A new config with dotted ``key=value`` overrides applied (values parsed as YAML).

        Example:
            >>> TrainerConfig(epochs=1).with_overrides(["optimizer.lr=3e-4", "epochs=5"]).epochs
            5
        """
        if isinstance(overrides, str):
            overrides = [overrides]
        data, problems = apply_well_formed_overrides(self.to_dict(), overrides, type(self))
        try:
            config = type(self).from_dict(data)
        except ConfigError as err:
            problems += err.problems
        if problems:  # malformed overrides and the problems of the well-formed ones, in one error
            raise ConfigError(problems)
        return config

    # ------------------------------------------------------------------------------------------ rules

    @rule("epochs", "max_steps")
    def _one_duration(self) -> Iterable[Problem]:
        if self.epochs is None and self.max_steps is None:
            yield Problem("epochs", "neither epochs nor max_steps is set", "set epochs=N or max_steps=N")
        elif self.epochs is not None and self.max_steps is not None:
            yield Problem(
                "max_steps",
                f"is set together with epochs ({self.epochs}); which one ends training would be ambiguous",
                "keep only one of epochs and max_steps",
            )

    @rule("eval_strategy", "eval_steps")
    def _eval_steps_match_strategy(self) -> Iterable[Problem]:
        yield from _steps_match_strategy("eval", self.eval_strategy, self.eval_steps)

    @rule("save_strategy", "save_steps")
    def _save_steps_match_strategy(self) -> Iterable[Problem]:
        yield from _steps_match_strategy("save", self.save_strategy, self.save_steps)

    @rule("eval_strategy", "early_stopping")
    def _early_stopping_needs_eval(self) -> Iterable[Problem]:
        if self.early_stopping is not None and self.eval_strategy == "no":
            yield Problem(
                "early_stopping",
                "needs evaluation results, but eval_strategy is 'no'",
                "set eval_strategy=epoch (or steps with eval_steps), or early_stopping=null",
            )

    @rule("metrics", "early_stopping")
    def _early_stopping_monitor(self) -> Iterable[Problem]:
        if self.early_stopping is None:
            return
        yield from _monitored("early_stopping.monitor", self.early_stopping.monitor, self.metrics)
        if self.early_stopping.resolved_mode is None:
            yield _unknown_direction("early_stopping.mode", self.early_stopping.monitor)

    @rule("metrics", "metric_for_best_model", "best_model_mode", "eval_strategy")
    def _best_model_metric(self) -> Iterable[Problem]:
        if self.eval_strategy == "no":
            return  # no evaluation, no ranking: metric_for_best_model keeps its default
        yield from _monitored("metric_for_best_model", self.metric_for_best_model, self.metrics)
        if self.best_model_mode is None and metric_mode(self.metric_for_best_model) is None:
            yield _unknown_direction("best_model_mode", self.metric_for_best_model)

    @rule("load_best_model_at_end", "eval_strategy", "eval_steps", "save_strategy", "save_steps")
    def _best_model_needs_evaluated_checkpoints(self) -> Iterable[Problem]:
        if not self.load_best_model_at_end:
            return
        if self.eval_strategy == "no":
            yield Problem(
                "load_best_model_at_end",
                "needs evaluation, but eval_strategy is 'no'",
                "set eval_strategy=epoch",
            )
        elif self.save_strategy == "no":
            yield Problem(
                "load_best_model_at_end",
                "needs checkpoints, but save_strategy is 'no'",
                f"set save_strategy={self.evaluates_every}",
            )
        elif self.save_strategy != (evaluated := self.evaluates_every):
            yield Problem(
                "save_strategy",
                f"is {self.save_strategy!r} but eval_strategy is {self.eval_strategy!r}: with "
                "load_best_model_at_end every checkpoint needs an evaluation result",
                f"set save_strategy={evaluated}",
            )
        elif self.save_steps and self.eval_steps and self.save_steps % self.eval_steps:
            yield Problem(
                "save_steps",
                f"({self.save_steps}) is not a multiple of eval_steps ({self.eval_steps}): with "
                "load_best_model_at_end every checkpoint needs an evaluation result",
                f"set save_steps to a multiple of {self.eval_steps}",
            )

    @rule("nonfinite", "max_consecutive_nonfinite")
    def _nonfinite_limit_needs_skip(self) -> Iterable[Problem]:
        if self.max_consecutive_nonfinite is not None and self.nonfinite != "skip":
            yield Problem(
                "max_consecutive_nonfinite",
                f"only applies with nonfinite=skip, but nonfinite is {self.nonfinite!r}",
                "set nonfinite=skip, or max_consecutive_nonfinite=null",
            )

    @rule("device")
    def _device_format(self) -> Iterable[Problem]:
        if not _DEVICE.fullmatch(self.device):
            yield Problem(
                "device",
                f"{self.device!r} is not a device this trainer accepts",
                "use 'auto', 'cpu', 'cuda', 'cuda:N' (N a GPU index) or 'mps'",
            )

    @rule("device", "mixed_precision")
    def _fp16_needs_gpu(self) -> Iterable[Problem]:
        if self.mixed_precision == "fp16" and self.device == "cpu":
            yield Problem(
                "mixed_precision",
                "fp16 is not supported on device 'cpu'",
                "use mixed_precision=bf16 on CPU, or a GPU",
            )

    @rule("device", "pin_memory")
    def _pin_memory_needs_gpu(self) -> Iterable[Problem]:
        if self.pin_memory and self.device == "cpu":
            yield Problem(
                "pin_memory", "only speeds up copies to a GPU, and device is 'cpu'", "set pin_memory=false"
            )

    @rule("num_workers", "prefetch_factor")
    def _prefetch_factor_needs_workers(self) -> Iterable[Problem]:
        if self.prefetch_factor is not None and self.num_workers == 0:
            yield Problem(
                "prefetch_factor",
                "is set but num_workers is 0 (no worker loads ahead)",
                "set num_workers, or prefetch_factor=null",
            )

    @rule("compile", "compile_mode")
    def _compile_mode_needs_compile(self) -> Iterable[Problem]:
        if self.compile_mode is not None and not self.compile:
            yield Problem(
                "compile_mode", "is set but compile is false", "set compile=true, or compile_mode=null"
            )

    @rule("compile", "compile_background")
    def _background_needs_auto(self) -> Iterable[Problem]:
        if self.compile_background is True and self.compile != "auto":
            yield Problem(
                "compile_background",
                f"is true but compile is {self.compile!r}: only the tiered step switches to a build made beside it",
                "set compile=auto, or compile_background=auto",
            )

    @rule("max_steps", "scheduler")
    def _warmup_within_run(self) -> Iterable[Problem]:
        warmup = self.scheduler.warmup_steps
        if self.max_steps is not None and warmup is not None and warmup >= self.max_steps:
            yield Problem(
                "scheduler.warmup_steps",
                f"({warmup}) is not shorter than the run (max_steps={self.max_steps})",
                f"set scheduler.warmup_steps below {self.max_steps}",
            )

    @rule("sharding", "sweep", "mixed_precision")
    def _sharding_supported(self) -> Iterable[Problem]:
        if self.sharding != "none":
            yield from _refused(self, _NOT_SHARDED, f"sharding={self.sharding!r}", "sharding=none")

    @rule("tensor_parallel", "tensor_parallel_plan", "tensor_parallel_check_batches")
    def _tensor_parallel_fields_need_it(self) -> Iterable[Problem]:
        if self.tensor_parallel > 1:
            return
        for name, unset in (("tensor_parallel_plan", None), ("tensor_parallel_check_batches", "first")):
            if getattr(self, name) != unset:
                yield Problem(
                    name, "only applies with tensor_parallel > 1, but tensor_parallel is 1", f"remove {name}"
                )

    @rule(
        "tensor_parallel", "sharding_blocks", "sweep", "mixed_precision", "dp_l2_norm_clip", "sam_rho",
        "save_strategy", "resume_from_checkpoint",
    )  # fmt: skip
    def _tensor_parallel_supported(self) -> Iterable[Problem]:
        if self.tensor_parallel > 1:
            yield from _refused(
                self, _NOT_WITH_TP, f"tensor_parallel={self.tensor_parallel}", "tensor_parallel=1"
            )

    @rule("dp_l2_norm_clip", "dp_noise_multiplier", "dp_target_epsilon")
    def _one_dp_noise(self) -> Iterable[Problem]:
        noise, target = self.dp_noise_multiplier, self.dp_target_epsilon
        if self.dp_l2_norm_clip is None:
            for name, value in (("dp_noise_multiplier", noise), ("dp_target_epsilon", target)):
                if value is not None:
                    yield Problem(name, "is set but DP-SGD is off", "set dp_l2_norm_clip too, or remove it")
        elif (noise is None) == (target is None):
            yield Problem(
                "dp_l2_norm_clip",
                "DP-SGD needs exactly one of dp_noise_multiplier and dp_target_epsilon",
                "set dp_noise_multiplier=1.0 (say), or dp_target_epsilon=8",
            )

    @rule(
        "dp_l2_norm_clip", "gradient_accumulation_steps", "sharding", "sweep", "pad_train_batches", "sam_rho"
    )
    def _dp_supported(self) -> Iterable[Problem]:
        if self.dp_l2_norm_clip is None:
            return
        for name, (on, why, fix) in _NOT_WITH_DP.items():
            if on(self):
                yield Problem(name, f"is not supported with DP-SGD (dp_l2_norm_clip): {why}", fix)

    @rule("sharding", "sharding_blocks")
    def _blocks_need_sharded_params(self) -> Iterable[Problem]:
        if self.sharding_blocks is None:
            return
        if self.sharding != "params":
            yield Problem(
                "sharding_blocks",
                f"needs sharding=params (blocks gather their sharded params), but sharding is {self.sharding!r}",
                "set sharding=params, or sharding_blocks=null",
            )
        elif "auto" in self.sharding_blocks and len(self.sharding_blocks) > 1:
            yield Problem("sharding_blocks", "'auto' finds the blocks itself", "give 'auto' alone, or names")
        elif not self.sharding_blocks or not all(isinstance(n, str) and n for n in self.sharding_blocks):
            yield Problem(
                "sharding_blocks", "needs 'auto' or non-empty class/submodule names", "write e.g. [BertLayer]"
            )

    @rule("init_weights_from", "resume_from_checkpoint")
    def _init_or_resume(self) -> Iterable[Problem]:
        if self.init_weights_from is not None and isinstance(self.resume_from_checkpoint, str):
            yield Problem(
                "init_weights_from",
                "would be overwritten: resume_from_checkpoint restores the weights from its checkpoint",
                "remove init_weights_from, or resume_from_checkpoint",
            )

    @rule("resume_from_checkpoint", "init_weights_from", "output_dir", "checkpoints_dir", "logs_dir")
    def _paths_not_empty(self) -> Iterable[Problem]:
        for name in (
            "output_dir",
            "checkpoints_dir",
            "logs_dir",
            "init_weights_from",
            "resume_from_checkpoint",
        ):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                yield Problem(name, "is an empty string", f"set {name} to a path, or leave it at its default")


# field -> (whether the config uses it, why a sharded state cannot, the fix): what sharding refuses.
# What DP-SGD's per-example gradient stage refuses (functrain.step.per_example), said in config terms.
_NOT_WITH_DP: dict[str, tuple[Any, str, str]] = {
    "gradient_accumulation_steps": (
        lambda c: c.gradient_accumulation_steps > 1,
        "the aggregate needs the whole batch's per-example gradients",
        "raise batch_size instead",
    ),
    "sharding": (
        lambda c: c.sharding != "none",
        "per-example gradients are not sharded",
        "set sharding=none",
    ),
    "sweep": (
        lambda c: bool(c.sweep),
        "an ensemble's per-example gradients are not supported",
        "remove sweep",
    ),
    "pad_train_batches": (
        lambda c: c.pad_train_batches,
        "padded rows would count in the batch size",
        "use drop_last=true instead",
    ),
    "sam_rho": (lambda c: c.sam_rho is not None, "SAM's perturbation is not private", "remove sam_rho"),
}

_NOT_SHARDED: dict[str, tuple[Any, str, str]] = {
    "sweep": (lambda c: bool(c.sweep), "an ensemble's stacked state is not sharded", "remove sweep"),
    "mixed_precision": (
        lambda c: c.mixed_precision == "fp16",
        "fp16's overflow check would be per rank",
        "use mixed_precision=bf16",
    ),
    "sam_rho": (
        lambda c: c.sam_rho is not None,
        "SAM's perturbation would need the global norm of sharded gradients",
        "remove sam_rho",
    ),
}

# What a tensor-parallel state (DTensor params, functrain.distributed.tensor_parallel) refuses, in config
# terms: what a sharded state refuses, and more (its checkpoints are saved whole and resume on any layout).
# sharding (ZeRO-1/2/3) shards over the mesh's dp axis; its blocks are refused.
_NOT_WITH_TP: dict[str, tuple[Any, str, str]] = {
    "sharding_blocks": (
        lambda c: c.sharding_blocks is not None,
        "the blocks gather their params inside the differentiated function, and making a gathered tp part "
        "a DTensor there needs DTensor.from_local, an autograd.Function without setup_context, which "
        "torch.func refuses",
        "remove sharding_blocks (sharding=params then gathers the params for the whole step, outside the "
        "gradient)",
    ),
    **_NOT_SHARDED,
    "dp_l2_norm_clip": (
        lambda c: c.dp_l2_norm_clip is not None,
        "per-example gradients of DTensor params are not supported",
        "remove dp_l2_norm_clip",
    ),
}


def _refused(
    config: TrainerConfig, table: Mapping[str, tuple[Any, str, str]], setting: str, off: str
) -> Iterable[Problem]:
    """A problem for each field of ``table`` (field -> (whether the config uses it, why, fix)) that the
    config uses, refused with ``setting`` (``"sharding='params'"``): its fix, or ``off``."""
    for name, (on, why, fix) in table.items():
        if on(config):
            yield Problem(name, f"is not supported with {setting}: {why}", f"{fix}, or set {off}")


def _steps_match_strategy(kind: str, strategy: str, steps: int | None) -> Iterable[Problem]:
    if strategy == "steps" and steps is None:
        yield Problem(f"{kind}_steps", f"is missing, but {kind}_strategy is 'steps'", f"set {kind}_steps=N")
    elif strategy != "steps" and steps is not None:
        yield Problem(
            f"{kind}_steps",
            f"is only used with {kind}_strategy='steps', but {kind}_strategy is {strategy!r}",
            f"set {kind}_strategy=steps, or remove {kind}_steps",
        )


def _monitored(path: str, name: str, metrics: Mapping[str, Any]) -> Iterable[Problem]:
    if name == "loss" or name in metrics:
        return
    available = ["loss", *metrics]
    hint = suggestion(name, available)
    yield Problem(
        path,
        f"{name!r} is not evaluated (evaluation yields: {', '.join(available)})",
        f"{hint + ' ' if hint else ''}add {name!r} to metrics or monitor 'loss'",
    )


def _unknown_direction(path: str, name: str) -> Problem:
    return Problem(
        path, f"cannot tell whether a higher or lower {name!r} is better", f"set {path}=max or {path}=min"
    )
