"""`plot_run`: loss and metric curves of a run, from its ``metrics.jsonl``, to a PNG.

One panel per metric; names that differ only before their last ``/`` (``train/loss`` and
``eval/loss``) share a panel. ``time/eta_s`` (a countdown, not a curve) is left out unless named.
matplotlib is imported lazily (the ``plot`` extra) and used without pyplot, so plotting never changes
a notebook's backend.

Example:
    >>> import tempfile, pathlib
    >>> from functrain.logging import JSONLWriter
    >>> run = tempfile.mkdtemp()
    >>> with JSONLWriter(run) as w:
    ...     w.write(1, {"train/loss": 1.0}); w.write(2, {"train/loss": 0.5})
    >>> plot_run(run, f"{run}/curves.png").stat().st_size > 0
    True
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from functrain.logging._optional import import_optional
from functrain.logging.jsonl import read_jsonl

__all__ = ["find_metrics", "plot_run", "save_panels"]

_NOT_CURVES = ("time/eta_s",)


def find_metrics(run_dir: str | os.PathLike[str]) -> Path:
    """The ``metrics.jsonl`` of a run: ``run_dir`` may be the run directory (``runs/x``, whose
    ``logs/`` holds it), the logs directory, or the file itself.

    Example:
        >>> find_metrics("runs/x")  # doctest: +SKIP
        PosixPath('runs/x/logs/metrics.jsonl')
    """
    root = Path(run_dir)
    if root.is_file():
        return root
    for candidate in (root / "metrics.jsonl", root / "logs" / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    found = sorted(root.glob("*/metrics.jsonl")) if root.is_dir() else []
    if len(found) == 1:
        return found[0]
    where = f"; several: {[str(f) for f in found]}, pass one of their directories" if found else ""
    raise FileNotFoundError(
        f"no metrics.jsonl in {os.fspath(run_dir)!r} or its logs/ directory{where} "
        "(it is written by JSONLWriter; the Trainer writes OUTPUT_DIR/logs/metrics.jsonl)"
    )


def plot_run(
    run_dir: str | os.PathLike[str], output_png: str | os.PathLike[str], names: Sequence[str] | None = None
) -> Path:
    """Render a run's curves (all, or ``names``) to ``output_png``; return its path.

    ``run_dir``: the run directory, its logs directory or the ``metrics.jsonl`` (see :func:`find_metrics`).
    """
    try:
        source = find_metrics(run_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"plot_run: {err}") from None
    series: dict[str, list[tuple[int, float]]] = {}
    for record in read_jsonl(source):
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, []).append((record["step"], float(value)))
    if names is not None:
        unknown = [n for n in names if n not in series]
        if unknown:
            close = {n: difflib.get_close_matches(n, list(series), n=3) for n in unknown}
            raise ValueError(
                f"plot_run: no scalars named {unknown} in {source} (close matches: {close}); "
                f"known: {sorted(series)}"
            )
        series = {n: series[n] for n in names}
    else:
        series = {n: v for n, v in series.items() if n not in _NOT_CURVES}
    if not series:
        raise ValueError(f"plot_run: {source} holds no scalars to plot")
    panels: dict[str, list[tuple[str, list[tuple[int, float]]]]] = {}
    for name, points in series.items():
        panels.setdefault(name.rsplit("/", 1)[-1], []).append((name, points))
    import_optional("matplotlib", "plot", "plot_run")  # the error names the function the user called
    return save_panels(panels, output_png)


def save_panels(
    panels: Mapping[str, Sequence[tuple[str, Sequence[tuple[int, float]]]]],
    output_png: str | os.PathLike[str],
    *,
    legend_on_every_panel: bool = True,
) -> Path:
    """Draw ``{panel title: [(line label, [(step, value), ...]), ...]}`` as a grid of panels (three a row) to
    ``output_png``; return its path. Uses matplotlib without pyplot (a notebook's backend stays as it was);
    raises an ``ImportError`` naming the ``plot`` extra when matplotlib is not installed. ``legend_on_every_panel=False`` puts the
    legend on the first panel only (when every panel has the same lines, as in a sweep).

    Example:
        >>> import tempfile
        >>> png = save_panels({"loss": [("train/loss", [(1, 1.0), (2, 0.5)])]}, f"{tempfile.mkdtemp()}/c.png")
        >>> png.stat().st_size > 0
        True
    """
    Figure = import_optional("matplotlib.figure", "plot", "save_panels").Figure

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5 * columns, 3.5 * rows))
    axes = figure.subplots(rows, columns, squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for name, points in lines:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if legend_on_every_panel:
            ax.legend(fontsize="small")
    if not legend_on_every_panel:
        axes.flat[0].legend(fontsize="x-small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    figure.tight_layout()
    output = Path(output_png)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    return output
