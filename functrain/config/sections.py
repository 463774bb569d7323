"""The nested sections of `TrainerConfig`: optimizer, scheduler, loss, early stopping, freezing, EMA.

Each section may also be written as a shorthand in YAML or on the command line: ``optimizer: sgd``,
``scheduler: cosine``, ``criterion: MSELoss`` (a name), ``early_stopping: true`` (the defaults),
``freeze: [encoder.*]`` (name patterns), ``ema: 0.999`` (a decay) or ``ema: true`` (the defaults).

Example:
    >>> OptimizerConfig(name="SGD", lr="0.1", args={"momentum": 0.9})
    OptimizerConfig(name='sgd', lr=0.1, weight_decay=0.0, args={'momentum': 0.9})
    >>> SchedulerConfig(name="warmup_cosine", warmup_ratio=0.1).warmup_ratio
    0.1
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from functrain.config.errors import ConfigError, Problem, suggestion
from functrain.config.imports import check_import_spec, imports_deferred
from functrain.config.names import (
    OPTIMIZER_ALIASES,
    OPTIMIZER_NAMES,
    SCHEDULER_ALIASES,
    SCHEDULER_NAMES,
    canonical_name,
    metric_mode,
    unsupported_name,
)
from functrain.config.section import ConfigSection, config_section, option, rule

__all__ = [
    "CriterionConfig",
    "EarlyStoppingConfig",
    "EmaConfig",
    "FreezeConfig",
    "OptimizerConfig",
    "SchedulerConfig",
]


def _reserved_args(path: str, args: Mapping[str, Any], reserved: Mapping[str, str]) -> Iterable[Problem]:
    for key, field in reserved.items():
        if key in args:
            yield Problem(f"{path}.{key}", "is a field of its own, not an argument", f"set {field} instead")


def _optimizer_name(value: Any, path: str) -> Any:
    return canonical_name(value, OPTIMIZER_ALIASES)


def _scheduler_name(value: Any, path: str) -> Any:
    return canonical_name(value, SCHEDULER_ALIASES)


def _name_problem(path: str, name: str, known: Iterable[str], what: str) -> Problem:
    unsupported = unsupported_name(what, name) if what in ("optimizer", "scheduler") else None
    if unsupported is not None:
        return Problem(path, f"unknown {what} {name!r}: {unsupported[0]}", unsupported[1])
    known = list(known)
    hint = suggestion(name, known)
    if hint and len(known) > 12:  # a long catalogue (torch.nn losses) would bury the suggestion
        return Problem(path, f"unknown {what} {name!r}", hint)
    return Problem(
        path, f"unknown {what} {name!r}", f"{hint + ' ' if hint else ''}choose one of: {', '.join(known)}"
    )


@config_section("optimizer")
class OptimizerConfig(ConfigSection):
    """Which ``functrain.optim`` optimizer to build, and its hyperparameters.

    Example:
        >>> OptimizerConfig(name="adamw", lr=3e-4, weight_decay=0.01, args={"betas": [0.9, 0.95]}).lr
        0.0003
    """

    name: str = option(
        "adamw",
        doc=f"Optimizer, one of {', '.join(OPTIMIZER_NAMES)} (Hugging Face's adamw_torch, adamw_torch_fused, "
        "adamw_hf: adamw).",
        normalize=_optimizer_name,
    )
    lr: float = option(
        1e-3, doc="Peak learning rate (the scheduler scales it per optimizer step).", greater_than=0
    )
    weight_decay: float = option(
        0.0, doc="Weight decay, applied as the named optimizer defines it.", minimum=0
    )
    args: dict[str, Any] = option(
        default_factory=dict, doc="Other keyword arguments of the optimizer, e.g. {betas: [0.9, 0.999]}."
    )

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        return {"name": value} if isinstance(value, str) else None

    @rule("name")
    def _known_name(self) -> Iterable[Problem]:
        if self.name not in OPTIMIZER_NAMES:
            yield _name_problem("optimizer.name", self.name, OPTIMIZER_NAMES, "optimizer")

    @rule("args")
    def _no_duplicate_settings(self) -> Iterable[Problem]:
        reserved = {
            "lr": "optimizer.lr",
            "learning_rate": "optimizer.lr",
            "weight_decay": "optimizer.weight_decay",
        }
        yield from _reserved_args("optimizer.args", self.args, reserved)


@config_section("scheduler")
class SchedulerConfig(ConfigSection):
    """The learning-rate schedule, counted in optimizer steps.

    A step is one optimizer update: with ``gradient_accumulation_steps=4`` that is four batches. Warm-up
    and the schedule's horizon are counted in these steps, never in samples or batches, and the
    schedule advances once per optimizer step.

    Example:
        >>> SchedulerConfig(name="cosine", warmup_steps=100).warmup_steps
        100
    """

    name: str = option(
        "constant",
        doc=f"Schedule, one of {', '.join(SCHEDULER_NAMES)} (Hugging Face's constant_with_warmup: constant).",
        normalize=_scheduler_name,
    )
    warmup_steps: int | None = option(
        None, doc="Linear warm-up from 0 over this many optimizer steps (or use warmup_ratio).", minimum=0
    )
    warmup_ratio: float | None = option(
        None,
        doc="Warm-up as a fraction of all optimizer steps of the run (or use warmup_steps).",
        minimum=0,
        less_than=1,
    )
    args: dict[str, Any] = option(
        default_factory=dict, doc="Other arguments of the schedule, e.g. {decay_rate: 0.5} for exponential."
    )

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        return {"name": value} if isinstance(value, str) else None

    @property
    def has_warmup(self) -> bool:
        """Whether a warm-up of more than zero steps is configured."""
        return bool(self.warmup_steps) or bool(self.warmup_ratio)

    @rule("name")
    def _known_name(self) -> Iterable[Problem]:
        if self.name not in SCHEDULER_NAMES:
            yield _name_problem("scheduler.name", self.name, SCHEDULER_NAMES, "scheduler")

    @rule("warmup_steps", "warmup_ratio")
    def _one_warmup(self) -> Iterable[Problem]:
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            yield Problem(
                "scheduler.warmup_ratio",
                "is set together with scheduler.warmup_steps",
                "keep one of them: warmup_steps counts optimizer steps, warmup_ratio a fraction of the run",
            )

    @rule("name", "warmup_steps", "warmup_ratio")
    def _one_cycle_has_own_warmup(self) -> Iterable[Problem]:
        if self.name == "one_cycle" and self.has_warmup:
            yield Problem(
                "scheduler.warmup_steps" if self.warmup_steps else "scheduler.warmup_ratio",
                "one_cycle has its own warm-up phase",
                "remove the warm-up and set the phase length in scheduler.args (e.g. pct_start: 0.3)",
            )

    @rule("args")
    def _no_duplicate_settings(self) -> Iterable[Problem]:
        reserved = {
            "warmup_steps": "scheduler.warmup_steps",
            "warmup_ratio": "scheduler.warmup_ratio",
            "lr": "optimizer.lr",
            "learning_rate": "optimizer.lr",
        }
        yield from _reserved_args("scheduler.args", self.args, reserved)


@functools.cache
def torch_loss_names() -> tuple[str, ...]:
    """Names of the loss classes in ``torch.nn`` (``"CrossEntropyLoss"``, ``"MSELoss"``, ...).

    Example:
        >>> "HuberLoss" in torch_loss_names()
        True
    """
    import torch  # here, not at the top: `functrain --help-config` stays fast

    base = torch.nn.modules.loss._Loss
    names = []
    for name in dir(torch.nn):
        obj = getattr(torch.nn, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, torch.nn.Module)
            and (issubclass(obj, base) or name.endswith("Loss"))
        ):
            names.append(name)
    return tuple(sorted(names))


@config_section("criterion")
class CriterionConfig(ConfigSection):
    """The criterion ``(preds, target) -> loss``: a ``torch.nn`` loss class by name, or an import spec
    ``"package.module:attr"`` (``Trainer(criterion=)`` is the same thing given as an object).

    ``args`` are checked against the class's signature, so a misspelled argument fails here.

    Example:
        >>> CriterionConfig(name="CrossEntropyLoss", args={"label_smoothing": 0.1}).args
        {'label_smoothing': 0.1}
    """

    name: str = option(
        "CrossEntropyLoss", doc="torch.nn loss class (e.g. MSELoss) or import spec 'package.module:attr'."
    )
    args: dict[str, Any] = option(
        default_factory=dict, doc="Keyword arguments of the loss, e.g. {reduction: sum}."
    )

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        return {"name": value} if isinstance(value, str) else None

    @rule("name", "args")
    def _known_loss_and_args(self) -> Iterable[Problem]:
        if imports_deferred():  # torch or the user's module: checked when validated outside the block
            return
        if ":" in self.name:
            try:
                loss_class = check_import_spec(self.name, "criterion.name")
            except ConfigError as err:
                yield from err.problems
                return
        else:
            import torch

            loss_class = getattr(torch.nn, self.name, None)
            if self.name not in torch_loss_names():  # also refuses non-loss modules such as Linear
                yield _name_problem("criterion.name", self.name, torch_loss_names(), "torch.nn loss")
                return
        yield from _args_fit_signature(loss_class, self.args, "criterion.args")


def _args_fit_signature(target: Any, args: Mapping[str, Any], path: str) -> Iterable[Problem]:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check against
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in args:
        if key not in accepted:
            hint = suggestion(key, accepted)
            yield Problem(
                f"{path}.{key}",
                f"is not an argument of {getattr(target, '__name__', target)}",
                f"{hint + ' ' if hint else ''}its arguments are: {', '.join(accepted)}",
            )


@config_section("early_stopping")
class EarlyStoppingConfig(ConfigSection):
    """Stop training when an evaluation result stops improving.

    Example:
        >>> EarlyStoppingConfig(monitor="accuracy", patience=5).resolved_mode
        'max'
    """

    monitor: str = option("loss", doc="Evaluation result to watch: 'loss' or a name from metrics.")
    mode: Literal["min", "max"] | None = option(
        None, doc="'min' or 'max': which direction is better; null infers it from the name (loss: min)."
    )
    patience: int = option(3, doc="Evaluations without improvement before training stops.", minimum=1)
    min_delta: float = option(
        0.0, doc="Smallest change of the monitored value that counts as improvement.", minimum=0
    )

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        return {} if value is True else None

    @property
    def resolved_mode(self) -> Literal["min", "max"] | None:
        """``mode``, or the direction inferred from the monitored name (None if it cannot be told)."""
        return self.mode or metric_mode(self.monitor)


@config_section("freeze")
class FreezeConfig(ConfigSection):
    """Parameters kept fixed during training (not updated by the optimizer).

    Example:
        >>> FreezeConfig(patterns=["encoder.*"], module_indices=[0], batchnorm=True).is_active
        True
    """

    patterns: list[str] = option(
        default_factory=list, doc="fnmatch globs over parameter names, e.g. ['encoder.*', 'embed.weight']."
    )
    module_indices: list[int] = option(
        default_factory=list, doc="Indices into model.children() to freeze (negative counts from the end)."
    )
    batchnorm: bool = option(False, doc="Freeze BatchNorm weights and keep their running statistics fixed.")

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        if isinstance(value, (str, list, tuple)):
            return {"patterns": value}
        return None

    @property
    def is_active(self) -> bool:
        """Whether anything is frozen."""
        return bool(self.patterns or self.module_indices or self.batchnorm)

    @rule("patterns")
    def _patterns_not_empty(self) -> Iterable[Problem]:
        for i, pattern in enumerate(self.patterns):
            if not pattern.strip():
                yield Problem(
                    f"freeze.patterns[{i}]", "is empty", "remove it or write a glob such as 'encoder.*'"
                )


@config_section("ema")
class EmaConfig(ConfigSection):
    """An exponential moving average of the weights (``functrain.optim.averaging.ema``), kept in the optimizer
    state: checkpointed and resumed with the run.

    Example:
        >>> EmaConfig.shorthand(0.9999)
        {'decay': 0.9999}
    """

    decay: float = option(
        0.999, doc="Weight of the old average at each optimizer step, in [0, 1).", minimum=0, less_than=1
    )
    warmup: bool = option(
        False, doc="Use min(decay, (1 + n) / (10 + n)) for the n-th average, so early averages forget faster."
    )
    evaluate: bool = option(
        True,
        doc="Evaluate (and pick the best checkpoint) with the averaged weights instead of the live ones.",
    )

    @classmethod
    def shorthand(cls, value: Any) -> Mapping[str, Any] | None:
        if value is True:
            return {}
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"decay": value}
        return None
