"""The Trainer a loaded config describes: its import specs (model, datasets) built, seeded by ``cfg.seed``.

``functrain train`` builds its run with it (the CLI wraps the user's exceptions for its one-line report),
and a background build rebuilds the same run's steps in a child process (:mod:`functrain.trainer.background`).

Example:
    >>> cfg = TrainerConfig.from_dict({"model": "mypkg.models:Net", "train_dataset": "mypkg.data:train"})  # doctest: +SKIP
    >>> trainer = trainer_from_config(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from functrain.compile.background import Warmup

__all__ = ["trainer_from_config", "warmups"]


def trainer_from_config(cfg: Any) -> Any:
    """A :class:`functrain.Trainer` for ``cfg`` (a ``TrainerConfig`` naming its model and datasets by import
    spec); raises ``ConfigError`` for a config without a model, and whatever the user's code raises."""
    import torch

    from functrain.config import ConfigError, build_object
    from functrain.trainer.core import Trainer

    if cfg.model is None:
        raise ConfigError.single("model", "the config names no model", "set model: package.module:ModelClass")

    def build(spec: Any, path: str) -> Any:
        return None if spec is None else build_object(spec, path=path)

    torch.manual_seed(cfg.seed)
    model = build(cfg.model, "model")
    trainer = Trainer(
        model,
        cfg,
        train_dataset=build(cfg.train_dataset, "train_dataset"),
        eval_dataset=build(cfg.eval_dataset, "eval_dataset"),
    )
    trainer.test_dataset = build(cfg.test_dataset, "test_dataset")
    return trainer


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
