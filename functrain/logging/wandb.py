"""`WandbWriter`: scalars to a Weights & Biases run (``pip install "functrain[wandb]"``).

The run starts at the first write. Its id is kept in ``log_dir/wandb_run_id``, so a resumed functrain run
(``fit(..., resume_from_checkpoint=...)``) continues the same W&B run (``resume="allow"``) instead of
starting a new one.
W&B's offline mode (``mode="offline"`` or ``WANDB_MODE=offline``) writes the run under ``log_dir/wandb``
for a later ``wandb sync``. Steps that a crashed run logged after its last checkpoint are already in W&B, which
ignores a step below its latest one: the resumed curve continues from where the crashed one stopped.

Example:
    >>> import tempfile  # doctest: +SKIP
    >>> writer = WandbWriter(tempfile.mkdtemp(), project="demo", mode="offline")  # doctest: +SKIP
    >>> writer.write(1, {"train/loss": 0.5})  # doctest: +SKIP
    >>> writer.close()  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from functrain.logging._optional import import_optional
from functrain.logging.writer import RunIdWriter, check_scalars

__all__ = ["WandbWriter"]


class WandbWriter(RunIdWriter):
    """``wandb.init`` at the first write, ``run.log(scalars, step=step)`` per write, ``run.finish()`` on close.

    Args:
        log_dir: the run's log folder: W&B's files go to ``log_dir/wandb`` and the run id to
            ``log_dir/wandb_run_id``.
        project, name, config, mode, tags: passed to ``wandb.init`` (``mode``: "online", "offline",
            "disabled"; default: W&B's, which honours ``WANDB_MODE``).
        init_kwargs: any other ``wandb.init`` argument (``entity``, ``group``, ...).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
        resume_step: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        self._wandb = import_optional("wandb", "wandb", "WandbWriter")
        self._init_kwargs: dict[str, Any] = {
            "project": project,
            "name": name,
            "config": dict(config) if config is not None else None,
            "mode": mode,
            "tags": tags,
            **init_kwargs,
        }
        self.run: Any = None
        super().__init__(log_dir, "wandb_run_id", resume_step)

    def _open(self, resume_step: int | None) -> None:
        kwargs = {k: v for k, v in self._init_kwargs.items() if v is not None}
        kwargs.setdefault("dir", str(self.path.parent))
        stored = self.stored_run_id(resume_step)
        if stored is not None:
            kwargs.setdefault("id", stored)
            kwargs.setdefault("resume", "allow")
        self.run = self._wandb.init(**kwargs)
        run_id = getattr(self.run, "id", None)
        if run_id:
            self.store_run_id(str(run_id))

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = check_scalars(step, scalars)
        self._ensure_open()
        self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
