"""Sweeps in the Trainer (``config.sweep``): the members' stacked state, the results table and plot, and
the winning member.

:func:`sweep_state` builds the stacked state whose member ``i`` has combination ``i`` of
:func:`functrain.ensemble.grid.grid` (its learning rate and weight decay in the optimizer state, its
seed's initialisation and random key); after training, :func:`results` reads each member's final and best
scalars from the history, :func:`write_results` saves them as CSV and markdown and :func:`plot_sweep`
draws every member's curves. :func:`state` and :func:`report` are these as the Trainer runs them.

Example:
    >>> from functrain.ensemble.grid import grid
    >>> h = History(); h.put("eval/loss/member_0", 0.5, 1); h.put("eval/loss/member_1", 0.25, 1)
    >>> best_index(results(h, grid({"seed": [0, 1]})), "eval/loss")
    1
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from functrain import distributed, ensemble, optim
from functrain.config import ConfigError, TrainerConfig
from functrain.config.sweep import SWEEPABLE
from functrain.core.member_names import lower_is_better, member_key
from functrain.ensemble.grid import grid, label
from functrain.ensemble.stacked import create
from functrain.logging.history import History
from functrain.logging.plot import save_panels
from functrain.optim.hyperparams import names_of
from functrain.precision import LossScale
from functrain.state import TrainState
from functrain.trainer.build import best_metric

__all__ = [
    "best_index",
    "best_member",
    "plot_sweep",
    "report",
    "results",
    "state",
    "sweep_state",
    "write_results",
]

log = logging.getLogger("functrain.ensemble")


def state(
    config: TrainerConfig, model: nn.Module, tx: optim.GradientTransformation, device: torch.device
) -> tuple[TrainState, list[dict[str, Any]]]:
    """The sweep's stacked state and its members (the grid of ``config.sweep``), refused with the field
    named where a sweep cannot run.

    Example:
        >>> import functrain as ft
        >>> cfg = ft.TrainerConfig(max_steps=1, sweep={"seed": [0, 1]})
        >>> s, members = state(cfg, torch.nn.Linear(2, 1), ft.optim.sgd(0.1), torch.device("cpu"))
        >>> members
        [{'seed': 0}, {'seed': 1}]
    """
    unsupported = "init_weights_from" if config.init_weights_from else None
    if distributed.is_distributed():
        unsupported = "data parallelism (torchrun)"
    if unsupported:
        raise ConfigError.single(
            "sweep",
            f"a sweep trains its members as one ensemble, which does not support {unsupported}",
            "run one training per value instead of a sweep",
        )
    members = grid(config.sweep)
    try:
        stacked = sweep_state(
            model,
            tx,
            members,
            seed=config.seed,
            base_lr=config.optimizer.lr,
            device=device,
            loss_scale=LossScale.create() if config.mixed_precision == "fp16" else None,
        )
    except ValueError as err:
        raise ConfigError.single("sweep", str(err), "sweep optimizer.lr or seed instead") from err
    return stacked, members


def report(
    config: TrainerConfig, history: History, members: Sequence[Mapping[str, Any]], out: Path
) -> tuple[int, list[dict[str, Any]]]:
    """After a sweep: the results table (``sweep_results.csv``/``.md``) and curves (``sweep_curves.png``)
    written in ``out``; returns the winning member by the final ``metric_for_best_model`` (the training
    loss when nothing is evaluated) and the rows.
    """
    rows = results(history, members)
    metric = best_metric(config)
    evaluated = f"{metric} (final)" in rows[0]  # every row has the same columns
    metric, mode = (metric, config.resolved_best_model_mode) if evaluated else ("train/loss", "min")
    best = best_index(rows, metric, mode)
    write_results(rows, out, best=best)
    plot_sweep(history, members, out / "sweep_curves.png")
    return best, rows


def best_member(stacked: TrainState, best: int) -> TrainState:
    """The winning member's state out of the sweep's stacked state."""
    return ensemble.member(stacked, best)


def sweep_state(
    model: nn.Module,
    tx: optim.GradientTransformation,
    members: Sequence[Mapping[str, Any]],
    *,
    seed: int,
    base_lr: float | None = None,
    device: str | torch.device | None = None,
    loss_scale: Any = None,
    metrics: Any = None,
) -> TrainState:
    """The stacked state of a sweep: member ``i`` carries ``members[i]``'s values.

    ``optimizer.lr`` sets the optimizer state's ``learning_rate``; under a schedule (whose learning rate is
    recomputed each step) it sets ``learning_rate_scale`` to ``lr / base_lr`` instead, so the member's
    schedule peaks at its own ``lr``. ``optimizer.weight_decay`` sets ``weight_decay``. ``seed`` gives the
    member its own initialisation (``functrain.ensemble.initialise``) and random key; without a swept seed
    every member starts from ``model``'s weights with the key of ``seed``.

    Example:
        >>> import functrain as ft
        >>> state = sweep_state(torch.nn.Linear(2, 1), ft.optim.adamw(1e-3), grid({"optimizer.lr": [1e-3, 1e-2]}), seed=0)
        >>> ft.optim.hyperparams(state.opt_state)["learning_rate"]
        tensor([0.0010, 0.0100])
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    in_state = list(optim.hyperparams(tx.init(params)))  # the names the optimizer state keeps
    hyperparams: dict[str, list[Any]] = {}
    for path, bare in SWEEPABLE.items():
        if bare is None or not any(path in m for m in members):
            continue
        values = [m[path] for m in members]
        names = names_of(bare, in_state)
        scales = names_of("learning_rate_scale", in_state) if bare == "learning_rate" else []
        if scales:  # a schedule recomputes the learning rate each step: sweep its scale
            if not base_lr:
                raise ValueError(
                    "sweep_state: a scheduled learning rate is swept as a scale of base_lr; give base_lr"
                )
            names, values = scales, [v / base_lr for v in values]
        if not names:
            raise ValueError(
                f"sweep: {path} cannot be swept: the optimizer keeps no {bare!r} in its state (it has "
                f"{sorted(in_state)}); for weight decay choose an optimizer that applies it (adamw) or set "
                "optimizer.weight_decay to a non-zero value"
            )
        for name in names:
            hyperparams[name] = values
    seeded = any("seed" in m for m in members)
    seeds = [int(m.get("seed", seed)) for m in members]
    return create(
        model,
        tx,
        seeds=seeds,
        hyperparams=hyperparams,
        share_init=not seeded,
        device=device,
        loss_scale=loss_scale,
        metrics=metrics,
    )


def _scalar_names(history: History) -> list[str]:
    """The scalars recorded per member (``eval/loss`` for ``eval/loss/member_0``...), train first."""
    suffix = "/" + member_key("", 0).lstrip("/")
    names = [n[: -len(suffix)] for n in history.names() if n.endswith(suffix) and not n.startswith("lr")]
    return sorted(names, key=lambda n: (not n.startswith("eval/"), n))


def results(history: History, members: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per member: its index, swept values, and the final and best value of each per-member scalar
    (best: the lowest for loss-like names, else the highest).

    Example:
        >>> h = History(); h.put("eval/loss/member_0", 0.5, 1); h.put("eval/loss/member_0", 0.7, 2)
        >>> results(h, [{"seed": 0}])
        [{'member': 0, 'seed': 0, 'eval/loss (final)': 0.7, 'eval/loss (best)': 0.5}]
    """
    rows = []
    names = _scalar_names(history)
    for i, values in enumerate(members):
        row: dict[str, Any] = {"member": i, **values}
        for name in names:
            series = [v for _, v in history.series(member_key(name, i))]
            finite = [v for v in series if math.isfinite(v)] or [math.nan]
            row[f"{name} (final)"] = series[-1]
            row[f"{name} (best)"] = min(finite) if lower_is_better(name) else max(finite)
        rows.append(row)
    return rows


def best_index(rows: Sequence[Mapping[str, Any]], metric: str, mode: str | None = None) -> int:
    """The member whose *final* ``metric`` (``"eval/accuracy"``) is best; ``mode`` ``"min"``/``"max"``
    (default: by the name). Non-finite values never win."""
    key = f"{metric} (final)"
    if not rows or key not in rows[0]:
        known = sorted({k.removesuffix(" (final)") for k in rows[0] if k.endswith("(final)")}) if rows else []
        raise KeyError(f"sweep: no per-member {metric!r} was recorded; recorded: {known}")
    low = (mode == "min") if mode is not None else lower_is_better(metric)

    def score(row: Mapping[str, Any]) -> float:
        v = row[key]
        if not math.isfinite(v):
            return math.inf
        return v if low else -v

    return min(range(len(rows)), key=lambda i: score(rows[i]))


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def write_results(
    rows: Sequence[Mapping[str, Any]], directory: str | os.PathLike[str], best: int | None = None
) -> tuple[Path, Path]:
    """Write ``sweep_results.csv`` and ``sweep_results.md`` (the ``best`` member marked) in ``directory``."""
    from functrain.core.atomic import replace_text

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0]) if rows else ["member"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    csv_path, md_path = directory / "sweep_results.csv", directory / "sweep_results.md"
    replace_text(csv_path, buffer.getvalue())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        mark = " (best)" if row["member"] == best else ""
        cells = [_fmt(row[c]) + (mark if c == "member" else "") for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    replace_text(md_path, "\n".join(lines) + "\n")
    return csv_path, md_path


def plot_sweep(
    history: History, members: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]
) -> Path | None:
    """Every member's curves (one panel per scalar, one line per member, labelled by its swept values) as a
    PNG at ``path``; ``None`` (and a log line) when matplotlib is not installed."""
    names = _scalar_names(history)
    if not names:
        return None
    panels = {
        name: [
            (label(values) or f"member {i}", history.series(member_key(name, i)))
            for i, values in enumerate(members)
        ]
        for name in names
    }
    try:
        return save_panels(panels, path, legend_on_every_panel=False)
    except ImportError as error:
        log.warning("sweep: matplotlib is not installed, so no plot of the curves (%s)", error)
        return None
