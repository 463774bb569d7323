"""The Trainer's background build: a child process rebuilds the run from its config and warms the caches.

A run whose config names its model and train dataset as import specs (``functrain train CONFIG.yaml``, or
a Trainer given such a config) can be rebuilt in another process: :func:`warmups` (the child's recipe)
builds the same Trainer with :func:`functrain.cli.main.trainer_from_config`, takes the first batch of its
own train and eval loaders, and hands the train and eval steps to
:class:`functrain.compile.background.BackgroundBuild`, which compiles them into the shared caches while
the run goes on eagerly (``compile: auto``). Whether to start one is ``compile_background``: ``auto`` where
cores are idle (:func:`functrain.compile.background.idle_cores`), or forced on or off.

Example:
    >>> build = background_build(trainer)  # doctest: +SKIP  (None: not wanted, or not rebuildable)
"""

from __future__ import annotations

import logging
from typing import Any

from functrain.compile.background import BackgroundBuild, Warmup, idle_cores, wanted

__all__ = ["background_build", "rebuildable", "warmups"]

log = logging.getLogger("functrain.jit")

_RECIPE = "functrain.trainer.background:warmups"


def rebuildable(trainer: Any) -> str | None:
    """Why ``trainer``'s steps cannot be rebuilt from its config in another process (``None``: they can)."""
    from functrain.trainer.core import Trainer

    cfg = trainer.config
    if cfg.model is None or cfg.train_dataset is None:
        return "its config names no model or train_dataset import spec"
    if type(trainer) is not Trainer:
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


def _first(loader: Any) -> Any:
    """The first batch of a :class:`functrain.data.Loader`'s first epoch (as ``fit`` gives it to the step)."""
    batches = loader.epoch(0)
    try:
        return next(batches)
    finally:
        batches.close()


def warmups(config: dict[str, Any]) -> list[Warmup]:
    """The child's recipe: the run's train step (and eval step, where the run evaluates) on the first batch
    of the run's own loaders."""
    import torch

    from functrain import tree
    from functrain.cli.main import trainer_from_config
    from functrain.config import TrainerConfig
    from functrain.trainer import averaging

    trainer = trainer_from_config(TrainerConfig.from_dict(config))
    cfg = trainer.config
    rows = cfg.batch_size * cfg.gradient_accumulation_steps
    batch = _first(trainer._loader(trainer.train_dataset, rows, train=True))
    clone = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731  (train may donate its)
    eval_state = tree.map(clone, averaging.eval_state(cfg, trainer.state))
    out = [Warmup(trainer._jit("train"), trainer.state, (batch,))]
    if cfg.eval_strategy != "no" and trainer.eval_dataset is not None:
        loader = trainer._loader(trainer.eval_dataset, cfg.resolved_eval_batch_size, train=False)
        out.append(Warmup(trainer._jit("eval"), eval_state, (_first(loader),)))
    return out
