"""The Trainer: a :class:`~functrain.config.TrainerConfig` turned into a run, from pure builders.

- :mod:`~functrain.trainer.core`: the :class:`Trainer` facade (extension points, ``train``/``evaluate``/
  ``predict``/``save``/``load``).
- :mod:`~functrain.trainer.build`: config -> optimizer, schedule, criterion, metrics, callbacks, loggers,
  checkpoint manager, loader, first state; each usable alone.
- :mod:`~functrain.trainer.averaging`: ``config.ema`` in one place; :mod:`~functrain.trainer.batches`: the
  batch layouts (``(inputs, target)``, Hugging Face dicts with ``labels``); :mod:`~functrain.trainer.run_dir`:
  the output directory; :mod:`~functrain.trainer.sweep`: ``config.sweep``, its results and best member.
- :mod:`~functrain.trainer.tasks` (image classification, segmentation presets) and
  :mod:`~functrain.trainer.demo` (``functrain demo``).

Example:
    >>> import functrain as ft
    >>> trainer = ft.Trainer(model, {"output_dir": "runs/a", "epochs": 2}, train_set)  # doctest: +SKIP
"""

from functrain.trainer.build import optimizer as build_optimizer
from functrain.trainer.build import resolve_device
from functrain.trainer.build import schedule as build_schedule
from functrain.trainer.core import Trainer
from functrain.trainer.run_dir import COMPILE_CACHE_DIR

__all__ = ["COMPILE_CACHE_DIR", "Trainer", "build_optimizer", "build_schedule", "resolve_device"]
