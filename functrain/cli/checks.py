"""The ``functrain`` command's checks before it imports torch or the user's code.

Everything that can be told from the YAML file, the overrides and the file system is checked here, in
well under a second: the config file (or ``--resume RUN_DIR``'s saved one) readable and valid (import
specs by their form only, see :func:`functrain.config.imports.deferred_imports`), the objects the command
needs named, checkpoint paths present. Each refusal is a :class:`~functrain.config.ConfigError`
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

__all__ = ["RUN_CONFIG", "load_config", "preflight", "run_config"]

# The resolved config the Trainer saves in its run directory (functrain.trainer.run_dir.start).
RUN_CONFIG = "config.yaml"
# functrain.checkpoint.manager's file names, and a sharded run's folders (functrain.checkpoint.sharded)
_CHECKPOINT_NAME = re.compile(r"^step_\d+\.(ckpt|shards)$")


def preflight(
    command: str,
    config_path: str | None,
    overrides: Sequence[str],
    *,
    split: str | None = None,
    checkpoint: str | None = None,
    resume: str | None = None,
) -> TrainerConfig:
    """Check what ``functrain COMMAND CONFIG.yaml OVERRIDES`` needs, importing neither torch nor the
    user's modules; returns the config (import specs not yet imported) or raises ``ConfigError``.

    ``split`` is the dataset eval/predict read (``"eval"``, ``"test"``, ``"train"``), ``checkpoint`` their
    ``--checkpoint``, ``resume`` train's ``--resume RUN_DIR`` (then ``config_path`` is ``None``).

    Example:
        >>> preflight("predict", "run.yaml", [], split="test")  # doctest: +SKIP
        ConfigError: test_dataset: the config names none. Fix: pass test_dataset=mytask:test_set ...
    """
    from functrain.config.imports import deferred_imports

    with deferred_imports():
        config, path = load_config(config_path, overrides, resume=resume)
    problems = _missing_objects(command, config, path.name, split)
    if command == "train":
        problems += _train_paths(config)
    elif command in ("eval", "predict"):
        problems += _checkpoint_to_read(config, checkpoint, path.name)
    if problems:
        raise ConfigError(problems)
    return config


def load_config(
    config_path: str | None, overrides: Sequence[str], *, resume: str | None = None
) -> tuple[TrainerConfig, Path]:
    """The config of ``CONFIG.yaml OVERRIDES``, or of ``--resume RUN_DIR OVERRIDES``: the run's saved
    ``config.yaml`` continued in place (``output_dir`` that folder, ``resume_from_checkpoint: true`` unless
    an override names a checkpoint); with the file it was read from.

    Example:
        >>> load_config(None, ["epochs=80"], resume="runs/sig")[0].output_dir  # doctest: +SKIP
        'runs/sig'
    """
    from functrain.config.trainer_config import TrainerConfig

    if resume is not None:
        path = run_config(resume)
        given = [o for o in overrides if o.partition("=")[0].strip() == "output_dir"]
        if given:
            raise ConfigError.single(
                "output_dir",
                f"{given[0]!r} with --resume, which continues {resume} in place",
                f"drop {given[0]!r}",
            )
        config = TrainerConfig.from_yaml(path).replace(output_dir=resume, resume_from_checkpoint=True)
    else:
        if config_path is None:
            raise ConfigError.single("CONFIG.yaml", "none given", "give a config file, or --resume RUN_DIR")
        path = Path(config_path)
        if not path.is_file():
            what = "is a directory, not a config file" if path.is_dir() else "no such file"
            fix = "give the path of a YAML config file, e.g. run.yaml"
            if path.is_dir() and (path / RUN_CONFIG).is_file():
                fix += f", or continue that run with --resume {path}"
            raise ConfigError.single(config_path, what, fix)
        config = TrainerConfig.from_yaml(path)
    if overrides:
        config = config.with_overrides(list(overrides))
    return config, path


def run_config(run_dir: str) -> Path:
    """``RUN_DIR/config.yaml``, the config the Trainer saved there, or a ``ConfigError`` saying why not."""
    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        what = "no such folder" if not Path(run_dir).exists() else f"holds no {RUN_CONFIG}"
        raise ConfigError.single(
            "--resume",
            f"{run_dir}: {what}, so it is not a run directory (a run saves its {RUN_CONFIG} there as it "
            "starts)",
            "give the output_dir of a run, e.g. --resume runs/sig",
        )
    return path


def _needed(command: str, config: TrainerConfig, split: str | None) -> list[str]:
    """The config fields naming the objects ``command`` builds or reads."""
    needed = ["model"]
    if command == "train":
        needed.append("train_dataset")
    if command in ("eval", "predict") and split:
        needed.append(f"{split}_dataset")
    if config.eval_strategy not in ("no", "auto"):  # the Trainer evaluates during training: it needs the data
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
            fix += ", or eval_strategy=auto (evaluates only when there is an eval set)"
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


def _train_paths(config: TrainerConfig) -> list[Problem]:
    problems = []
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
