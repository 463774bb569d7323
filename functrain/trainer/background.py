"""The Trainer's background build: a child process rebuilds the run from its config and warms the caches.

A run whose config names its model and train dataset as import specs (``functrain train CONFIG.yaml``, or
a Trainer given such a config) can be rebuilt in another process: the child's recipe
(:func:`functrain.trainer.from_config.warmups`) builds the same Trainer from the config, takes the first
batch of its own train and eval loaders, and hands the train and eval steps to
:class:`functrain.compile.background.BackgroundBuild`, which compiles them into the shared caches while
the run goes on eagerly (``compile: auto``). Whether to start one is ``compile_background``: ``auto`` where
cores are idle (:func:`functrain.compile.background.idle_cores`), or forced on or off.

Example:
    >>> build = background_build(trainer)  # None: not wanted, or not rebuildable  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any

from functrain.compile.background import BackgroundBuild, idle_cores, wanted

__all__ = ["background_build", "rebuildable"]

log = logging.getLogger("functrain.jit")

_RECIPE = "functrain.trainer.from_config:warmups"  # what the child runs


def rebuildable(trainer: Any) -> str | None:
    """Why ``trainer``'s steps cannot be rebuilt from its config in another process (``None``: they can)."""
    cfg = trainer.config
    if cfg.model is None or cfg.train_dataset is None:
        return "its config names no model or train_dataset import spec"
    if type(trainer).__module__ != "functrain.trainer.core":  # the child builds a plain Trainer
        return f"{type(trainer).__name__} is a subclass of Trainer"
    given = {
        "loss_fn": trainer.loss_fn, "optimizer": trainer._optimizer_override,
        "data_collator": trainer.data_collator, "callbacks": trainer.extra_callbacks or None,
    }  # fmt: skip
    passed = [name for name, value in given.items() if value is not None]
    if passed:
        return f"the Trainer was given {', '.join(passed)} outside its config"
    if cfg.sweep:
        return "a sweep"
    from functrain import distributed

    if distributed.is_distributed():
        return "it runs under torchrun"
    return None


def background_build(trainer: Any) -> BackgroundBuild | None:
    """The :class:`BackgroundBuild` of ``trainer``'s run where ``compile: auto`` and ``compile_background``
    want one and the run is :func:`rebuildable`; else ``None`` (one log line says why, where it was asked)."""
    cfg = trainer.config
    if cfg.compile != "auto" or cfg.compile_background is False:
        return None
    want, why = wanted(cfg.compile_background, trainer.device)
    if not want:
        log.debug("no background build: %s", why)
        return None
    reason = rebuildable(trainer)
    if reason is not None:
        level = logging.WARNING if cfg.compile_background is True else logging.DEBUG
        log.log(level, "compile_background: the run cannot be rebuilt in a child process: %s", reason)
        return None
    config = cfg.replace(compile_background=False, progress_bar=False, print_summary=False).to_dict()
    return BackgroundBuild(_RECIPE, {"config": config}, workers=max(1, idle_cores(trainer.device)))
