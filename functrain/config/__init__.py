"""Trainer configuration: the typed `TrainerConfig`, its YAML form, command-line overrides and help.

Every field of `TrainerConfig` is consumed by the Trainer; none is accepted and then ignored, and
settings made meaningless by another one are refused. All problems of a config are reported at once
in a single :class:`ConfigError` (a ``ValueError``), each naming its dotted field path and the fix.

- :class:`TrainerConfig` with sections :class:`OptimizerConfig`, :class:`SchedulerConfig`,
  :class:`CriterionConfig`, :class:`EarlyStoppingConfig`, :class:`FreezeConfig`;
- ``from_dict`` / ``to_dict``, ``from_yaml`` / ``to_yaml`` / ``save``, ``with_overrides``;
- :func:`config_help` for ``functrain train --help-config``;
- :func:`resolve_object` for import specs (``"package.module:attr"`` or ``{target, args, kwargs}``);
- :data:`OPTIMIZER_NAMES` and :data:`SCHEDULER_NAMES`, the names accepted for optimizer and scheduler.

Example:
    >>> from functrain.config import TrainerConfig
    >>> config = TrainerConfig.from_yaml('''
    ... epochs: 3
    ... optimizer: {name: adamw, lr: 3e-4}
    ... metrics: [accuracy]
    ... metric_for_best_model: accuracy
    ... ''')
    >>> config.with_overrides(["optimizer.lr=1e-3"]).optimizer.lr
    0.001
"""

from functrain.config.errors import ConfigError, Problem
from functrain.config.help import config_help
from functrain.config.imports import ImportSpec, add_import_dirs, build_object, resolve_object
from functrain.config.names import OPTIMIZER_NAMES, SCHEDULER_NAMES, metric_mode
from functrain.config.sections import (
    CriterionConfig,
    EarlyStoppingConfig,
    EmaConfig,
    FreezeConfig,
    OptimizerConfig,
    SchedulerConfig,
)
from functrain.config.trainer_config import TrainerConfig

__all__ = [
    "OPTIMIZER_NAMES",
    "SCHEDULER_NAMES",
    "ConfigError",
    "CriterionConfig",
    "EarlyStoppingConfig",
    "EmaConfig",
    "FreezeConfig",
    "ImportSpec",
    "OptimizerConfig",
    "Problem",
    "SchedulerConfig",
    "TrainerConfig",
    "add_import_dirs",
    "build_object",
    "config_help",
    "metric_mode",
    "resolve_object",
]
