"""The ``functrain plot RUN_DIR`` sub-command.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="functrain")
    >>> _ = register(parser.add_subparsers(dest="command"))
    >>> parser.parse_args(["plot", "runs/a", "--names", "train/loss,eval/loss"]).names
    'train/loss,eval/loss'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "register"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", help="a run directory (OUTPUT_DIR, whose logs/ holds metrics.jsonl), its logs/ or the file"
    )
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    parser.add_argument("--names", default=None, help="comma-separated scalar names (default: all)")


def _run(args: argparse.Namespace) -> int:
    import os

    from functrain.logging.plot import plot_run

    run_dir = os.path.dirname(args.run_dir) if os.path.isfile(args.run_dir) else args.run_dir
    output = args.output or os.path.join(run_dir, "metrics.png")
    names = [n.strip() for n in args.names.split(",") if n.strip()] if args.names else None
    try:
        path = plot_run(args.run_dir, output, names)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"functrain plot: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plot`` to an ``argparse`` sub-parsers object; the parsed namespace's ``func(args)`` runs it."""
    parser = subparsers.add_parser("plot", help="render loss and metric curves of a run to a PNG")
    _add_arguments(parser)
    parser.set_defaults(func=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``functrain plot`` on its own: ``main(["runs/a", "-o", "a.png"])`` returns the exit status."""
    parser = argparse.ArgumentParser(prog="functrain plot", description="render a run's curves to a PNG")
    _add_arguments(parser)
    return _run(parser.parse_args(argv))
