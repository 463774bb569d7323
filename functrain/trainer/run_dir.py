"""The run directory (``output_dir``): which folder a run writes, written once the run has been checked
against it, and what ``resume_from_checkpoint`` resumes.

A rerun never refuses and never overwrites: when ``output_dir`` already holds a run and the config asks
neither to resume it nor to overwrite it, the run writes the first free version beside it,
``<output_dir>-1``, ``<output_dir>-2``, ... (Lightning's ``version_N``, as siblings: each version is a
whole run directory, resumed with ``functrain train --resume <dir>`` like any other). Two runs started
at the same moment in one ``output_dir`` may both choose the same free version: give concurrent runs
their own ``output_dir``.

Example:
    >>> import functrain as ft
    >>> resume_argument(ft.TrainerConfig(max_steps=1))
    False
    >>> resolve(ft.TrainerConfig(output_dir="runs/reg", max_steps=1))  # doctest: +SKIP
    PosixPath('runs/reg-1')
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from functrain import distributed
from functrain.callbacks import Callback, LambdaCallback
from functrain.config import ConfigError, TrainerConfig
from functrain.model_summary import summary

__all__ = [
    "COMPILE_CACHE_DIR",
    "holds_a_run",
    "resolve",
    "resume_argument",
    "start",
    "start_callback",
    "version_path",
]

# Inside output_dir: torch's portable compile cache (functrain.jit's cache_dir), kept across runs.
COMPILE_CACHE_DIR = "compile-cache"


def holds_a_run(out: Path) -> bool:
    """Whether ``out`` holds anything but the compile cache (a folder of its own is not a run).

    Example:
        >>> holds_a_run(Path("no/such/folder"))
        False
    """
    try:
        return out.is_dir() and any(p.name != COMPILE_CACHE_DIR for p in out.iterdir())
    except OSError:
        return False  # unreadable: writing into it reports the real error


def version_path(out: Path, version: int) -> Path:
    """The folder of ``out``'s version ``version`` (``0``: ``out`` itself), a sibling of ``out``.

    Example:
        >>> version_path(Path("runs/reg"), 1).as_posix(), version_path(Path("runs/reg"), 0).as_posix()
        ('runs/reg-1', 'runs/reg')
    """
    if version == 0:
        return out
    name = out.name or Path(os.path.abspath(out)).name  # "." and "runs/" name their folder too
    return out.parent / f"{name}-{version}"


def resolve(config: TrainerConfig) -> Path:
    """The folder this run writes: ``config.output_dir``, or its first free version (:func:`version_path`)
    when it holds a run and the config asks neither to resume it nor to overwrite it.

    Rank 0 looks and every rank gets its answer (a broadcast), so the ranks of a torchrun job agree
    before any of them writes. A new version is announced on stderr (rank 0).

    Example:
        >>> resolve(TrainerConfig(output_dir="runs/new", max_steps=1)).as_posix()  # doctest: +SKIP
        'runs/new'
    """
    out = Path(config.output_dir)
    if config.overwrite_output_dir or config.resume_from_checkpoint is not False:
        return out
    version = 0
    if distributed.is_main_process():
        while holds_a_run(version_path(out, version)):
            version += 1
    if distributed.is_distributed():
        version = int(distributed.replicate(torch.tensor(version)))
    if version and distributed.is_main_process():
        print(
            f"output_dir {str(out)!r} holds a run: this run writes {str(version_path(out, version))!r} "
            "(resume_from_checkpoint=true continues the run in output_dir, overwrite_output_dir=true "
            "replaces it)",
            file=sys.stderr,
            flush=True,
        )
    return version_path(out, version)


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
