"""``functrain inspect`` and ``functrain export``: look into a checkpoint and convert its weights.

``inspect`` reads only the header, so it is instant even for a large checkpoint.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="functrain")
    >>> register(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["inspect", "run/step_00000100.ckpt"])
    >>> args.func(args)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from functrain.checkpoint.memory import human_size

__all__ = ["register"]


def _inspect(args: argparse.Namespace) -> int:
    from functrain.checkpoint.file import read_header  # torch: only when the command runs

    header = read_header(args.checkpoint)
    out = sys.stdout
    print(f"checkpoint: {args.checkpoint}", file=out)
    print(f"step: {header.step}", file=out)
    print(f"format version: {header.format_version}", file=out)
    print(f"written by: functrain {header.functrain_version}, torch {header.torch_version}", file=out)
    if header.metrics:
        print(f"metrics: {json.dumps(header.metrics)}", file=out)
    if header.metadata:
        print(f"metadata: {json.dumps(header.metadata)}", file=out)
    print(f"tensors: {len(header.tensors)}, {human_size(header.num_bytes)}", file=out)
    width = max((len(t.path) for t in header.tensors), default=4)
    for info in header.tensors:
        dtype = str(info.dtype).removeprefix("torch.")
        print(
            f"  {info.path:<{width}}  {dtype:<16} {list(info.shape)!s:<20} {human_size(info.nbytes):>10}",
            file=out,
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    from functrain.checkpoint.interop import export

    state_dict = export(args.checkpoint, args.output, format=args.format)
    print(f"wrote {len(state_dict)} tensors to {args.output} ({args.format})")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``inspect`` and ``export`` sub-commands to an argparse ``subparsers`` object.

    Each sets ``func``: call ``args.func(args)``, which returns the exit status; a bad checkpoint raises
    ``CheckpointError``, which ``functrain``'s main reports on one line with status 2.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> register(parser.add_subparsers())
        >>> parser.parse_args(["export", "a.ckpt", "--format", "pt", "--output", "a.pt"]).format
        'pt'
    """
    inspect = subparsers.add_parser(
        "inspect", help="print a checkpoint's step, versions and tensors (header only)"
    )
    inspect.add_argument("checkpoint", metavar="CKPT", help="a functrain checkpoint file")
    inspect.set_defaults(func=_inspect)
    export_parser = subparsers.add_parser(
        "export", help="write a checkpoint's weights as safetensors or a .pt file"
    )
    export_parser.add_argument("checkpoint", metavar="CKPT", help="a functrain checkpoint file")
    export_parser.add_argument("--format", choices=("safetensors", "pt"), required=True)
    export_parser.add_argument("--output", metavar="PATH", required=True, help="the file to write")
    export_parser.set_defaults(func=_export)
