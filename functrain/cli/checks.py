"""The ``functrain`` command's checks before it imports torch or the user's code.

Everything that can be told from the YAML file, the overrides and the file system is checked here, in
well under a second: the config file readable and valid (import specs by their form only, see
:func:`functrain.config.imports.deferred_imports`), the objects the command needs named, ``output_dir``
free or resumable, checkpoint paths present. Each refusal is a :class:`~functrain.config.ConfigError`
whose fix names the override (or YAML line) that makes the command work. The Trainer checks the same
things again once the objects are built and stays the authority; these are the early, cheap answers.

Example:
    >>> preflight("train", "run.yaml", ["epochs=2"])  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from functrain.config.errors import ConfigError, Problem

if TYPE_CHECKING:
    from functrain.config.trainer_config import TrainerConfig

__all__ = ["preflight"]

# Kept in output_dir across runs and not a run by itself (functrain.trainer.COMPILE_CACHE_DIR).
_COMPILE_CACHE_DIR = "compile-cache"
# functrain.checkpoint.manager's file names, and a sharded run's folders (functrain.checkpoint.sharded)
_CHECKPOINT_NAME = re.compile(r"^step_\d+\.(ckpt|shards)$")


def preflight(
    command: str,
    config_path: str,
    overrides: Sequence[str],
    *,
    split: str | None = None,
    checkpoint: str | None = None,
) -> TrainerConfig:
    """Check what ``functrain COMMAND CONFIG.yaml OVERRIDES`` needs, importing neither torch nor the
    user's modules; returns the config (import specs not yet imported) or raises ``ConfigError``.

    ``split`` is the dataset eval/predict read (``"eval"``, ``"test"``, ``"train"``), ``checkpoint`` their
    ``--checkpoint``.

    Example:
        >>> preflight("predict", "run.yaml", [], split="test")  # doctest: +SKIP
        ConfigError: test_dataset: the config names none. Fix: pass test_dataset=mytask:test_set ...
    """
    from functrain.config.imports import deferred_imports
    from functrain.config.trainer_config import TrainerConfig

    path = Path(config_path)
    if not path.is_file():
        what = "is a directory, not a config file" if path.is_dir() else "no such file"
        raise ConfigError.single(config_path, what, "give the path of a YAML config file, e.g. run.yaml")
    with deferred_imports():
        config = TrainerConfig.from_yaml(path)
        if overrides:
            config = config.with_overrides(list(overrides))
    problems = _missing_objects(command, config, path.name, split)
    if command == "train":
        problems += _train_paths(config)
    elif command in ("eval", "predict"):
        problems += _checkpoint_to_read(config, checkpoint, path.name)
    if problems:
        raise ConfigError(problems)
    return config


def _needed(command: str, config: TrainerConfig, split: str | None) -> list[str]:
    """The config fields naming the objects ``command`` builds or reads."""
    needed = ["model"]
    if command == "train":
        needed.append("train_dataset")
    if command in ("eval", "predict") and split:
        needed.append(f"{split}_dataset")
    if config.eval_strategy != "no":  # the Trainer evaluates during training: it needs the data
        needed.append("eval_dataset")
    if command == "summary":
        needed = ["model"]
    return list(dict.fromkeys(needed))


def _missing_objects(command: str, config: TrainerConfig, yaml_name: str, split: str | None) -> list[Problem]:
    module = _a_module_of(config)
    problems = []
    for field in _needed(command, config, split):
        if getattr(config, field) is not None:
            continue
        example = f"{module}:{'Net' if field == 'model' else field.replace('_dataset', '_set')}"
        fix = f"pass {field}={example} on the command line, or add '{field}: {example}' to {yaml_name}"
        if field == "eval_dataset" and command == "train":
            fix += ", or turn evaluation off with eval_strategy=no"
        problems.append(Problem(field, f"the config names none, and {command} needs it", fix))
    return problems


def _a_module_of(config: TrainerConfig) -> str:
    """The module of a spec the config already names (for the examples in fixes), else ``mytask``."""
    for field in ("model", "train_dataset", "eval_dataset", "test_dataset"):
        spec = getattr(config, field)
        target = spec if isinstance(spec, str) else (spec or {}).get("target")
        if isinstance(target, str) and ":" in target:
            return target.partition(":")[0]
    return "mytask"


def _holds_a_run(out: Path) -> bool:
    """Whether ``out`` holds anything but the compile cache (the Trainer's rule for "another run")."""
    try:
        return out.is_dir() and any(p.name != _COMPILE_CACHE_DIR for p in out.iterdir())
    except OSError:
        return False  # unreadable: the Trainer reports it with its own error


def _train_paths(config: TrainerConfig) -> list[Problem]:
    problems = []
    out = Path(config.output_dir)
    if not (config.overwrite_output_dir or config.resume_from_checkpoint) and _holds_a_run(out):
        problems.append(
            Problem(
                "output_dir",
                f"{str(out)!r} already holds a run",
                "pass resume_from_checkpoint=true to continue it, overwrite_output_dir=true to replace it, "
                "or output_dir=ANOTHER_DIR",
            )
        )
    for field in ("resume_from_checkpoint", "init_weights_from"):
        value = getattr(config, field)
        if isinstance(value, str) and not os.path.exists(value):
            fix = "give an existing checkpoint file"
            if field == "resume_from_checkpoint":
                fix += ", or resume_from_checkpoint=true (the run's latest checkpoint)"
            problems.append(Problem(field, f"no such file: {value}", fix))
    return problems


def _checkpoint_to_read(config: TrainerConfig, checkpoint: str | None, yaml_name: str) -> list[Problem]:
    if checkpoint is not None:
        if os.path.isfile(checkpoint) or (os.path.isdir(checkpoint) and checkpoint.endswith(".shards")):
            return []
        what = "is a directory, not a checkpoint file" if os.path.isdir(checkpoint) else "no such file"
        return [
            Problem(
                "--checkpoint",
                f"{checkpoint}: {what}",
                "give a checkpoint file, e.g. RUN/checkpoints/step_N.ckpt",
            )
        ]
    directory = Path(config.output_dir) / config.checkpoints_dir
    try:
        found = any(_CHECKPOINT_NAME.match(name) for name in os.listdir(directory))
    except OSError:
        found = False
    if found:
        return []
    return [
        Problem(
            "output_dir",
            f"no checkpoint in {directory}",
            f"train first (functrain train {yaml_name}), pass --checkpoint PATH, or output_dir=RUN_DIR of a "
            "trained run",
        )
    ]
