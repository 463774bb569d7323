"""The one exception the checkpoint package raises for bad files and mismatched trees."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(Exception):
    """A checkpoint could not be written, read or restored; the message names the file, path or field.

    Every malformed file (truncated, corrupted, crafted) raises this rather than crashing or
    allocating memory it declares, so callers can catch one type.

    Example:
        >>> try:
        ...     raise CheckpointError("run/step_10.ckpt: file is truncated")
        ... except CheckpointError as error:
        ...     print(error)
        run/step_10.ckpt: file is truncated
    """
