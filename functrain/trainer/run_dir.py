"""The run directory (``output_dir``): refused when it holds another run, written once the run has been
checked against it, and what ``resume_from_checkpoint`` resumes.

Example:
    >>> import functrain as ft
    >>> resume_argument(ft.TrainerConfig(max_steps=1))
    False
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from functrain import distributed
from functrain.callbacks import Callback, LambdaCallback
from functrain.config import ConfigError, TrainerConfig
from functrain.model_summary import summary

__all__ = ["COMPILE_CACHE_DIR", "check", "resume_argument", "start", "start_callback"]

# Inside output_dir: torch's portable compile cache (functrain.jit's cache_dir), kept across runs.
COMPILE_CACHE_DIR = "compile-cache"


def check(config: TrainerConfig, out: Path) -> None:
    """Refuse an ``output_dir`` holding a run unless the config says to overwrite or resume it."""
    if (
        not out.exists()
        or not any(p.name != COMPILE_CACHE_DIR for p in out.iterdir())
        or config.overwrite_output_dir
        or config.resume_from_checkpoint
    ):
        return
    raise FileExistsError(
        f"output_dir {str(out)!r} already holds a run; set overwrite_output_dir: true to replace it, "
        "resume_from_checkpoint: true to continue it, or choose another output_dir"
    )


def start(config: TrainerConfig, out: Path, model: nn.Module, frozen: set[str]) -> None:
    """Write the run directory (on rank 0): the run has been checked against it."""
    if not distributed.is_main_process():
        return
    if config.overwrite_output_dir and not config.resume_from_checkpoint and out.exists():
        for sub in (config.checkpoints_dir, config.logs_dir):
            shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.yaml")
    if config.print_summary:
        print(summary(model, frozen=frozen))


def start_callback(config: TrainerConfig, out: Path, model: nn.Module, frozen: set[str]) -> Callback:
    """:func:`start` at ``train_begin``: ``fit`` has restored the checkpoint (refusing one of another model)
    and checked the data before that first event, so a refused run writes nothing in ``out``."""
    return LambdaCallback(
        "run_directory", on_train_begin=lambda s, ctx: start(config, out, model, frozen) or s
    )


def resume_argument(config: TrainerConfig) -> Any:
    """``fit``'s ``resume_from_checkpoint``: ``False``, ``True`` (the latest checkpoint) or an existing
    checkpoint's path."""
    r = config.resume_from_checkpoint
    if r is False or r is True:
        return r
    path = Path(r)
    if not path.exists():
        raise ConfigError.single(
            "resume_from_checkpoint", f"no checkpoint at {r}", "give an existing checkpoint file or true"
        )
    return os.fspath(path)
