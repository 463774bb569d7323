"""`plot_run`: loss and metric curves of a run, from its ``metrics.jsonl``, to a PNG.

One panel per metric; names that differ only before their last ``/`` (``train/loss`` and
``eval/loss``) share a panel. matplotlib is imported lazily (the ``plot`` extra) with the Agg backend.

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
from collections.abc import Sequence
from pathlib import Path

from functrain.logging.jsonl import read_jsonl

__all__ = ["plot_run"]


def plot_run(
    run_dir: str | os.PathLike[str], output_png: str | os.PathLike[str], names: Sequence[str] | None = None
) -> Path:
    """Render the curves in ``run_dir/metrics.jsonl`` (all, or ``names``) to ``output_png``; return its path."""
    source = Path(run_dir) / "metrics.jsonl"
    if not source.exists():
        raise FileNotFoundError(
            f"plot_run: no metrics.jsonl in {os.fspath(run_dir)!r}; was it written by JSONLWriter?"
        )
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
    if not series:
        raise ValueError(f"plot_run: {source} holds no scalars to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plot_run needs matplotlib: pip install 'functrain[plot]'") from err

    panels: dict[str, list[str]] = {}
    for name in series:
        panels.setdefault(name.rsplit("/", 1)[-1], []).append(name)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
    for ax, (title, members) in zip(axes.flat, panels.items()):
        for name in members:
            steps, values = zip(*series[name])
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    figure.tight_layout()
    output = Path(output_png)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output
