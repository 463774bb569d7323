"""`ConsoleWriter`: one readable line per logged step.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> ConsoleWriter(out, prefix="epoch 1/2").write(10, {"loss": 0.123456, "epoch": 1})
    >>> out.getvalue()
    'epoch 1/2 | step 10 | loss 0.12346 | epoch 1\\n'
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from functrain.logging.writer import WriterBase, check_scalars

__all__ = ["ConsoleWriter", "format_scalar"]


def format_scalar(value: float) -> str:
    """Ints as ints, floats with 5 significant digits.

    Example:
        >>> format_scalar(3), format_scalar(0.000123456)
        ('3', '0.00012346')
    """
    return str(value) if isinstance(value, int) else f"{value:.5g}"


class ConsoleWriter(WriterBase):
    """Writes ``[prefix | ]step N | name value | ...`` to ``stream`` (stdout by default)."""

    def __init__(self, stream: TextIO | None = None, *, prefix: str = "") -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.prefix = prefix

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        scalars = check_scalars(step, scalars)
        parts = [self.prefix] if self.prefix else []
        parts.append(f"step {step}")
        parts += [f"{name} {format_scalar(value)}" for name, value in scalars.items()]
        self.stream.write(" | ".join(parts) + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        # The stream belongs to the caller (stdout): flush it, never close it.
        self.flush()
