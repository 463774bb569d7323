"""Exception notes: where in the data stream an error happened, added to the error as it is.

``add_note`` keeps the original exception (its type, message and traceback) and appends a line that
Python prints below the message (PEP 678, Python 3.11+). On Python 3.10 the line is kept in
``__notes__`` as 3.11 would, which tracebacks there do not print.

Example:
    >>> try:
    ...     try:
    ...         raise OSError("read failed")
    ...     except OSError as err:
    ...         add_note(err, "while loading example index 57")
    ...         raise
    ... except OSError as err:
    ...     err.__notes__
    ['while loading example index 57']
"""

from __future__ import annotations

import contextlib

__all__ = ["add_note"]


def add_note(error: BaseException, note: str) -> None:
    """Append ``note`` to ``error``'s notes (``error.add_note``; on Python 3.10, ``error.__notes__``)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return
    # Python 3.10: the attribute that 3.11 reads; an exception type that takes no attributes stays as it is
    with contextlib.suppress(AttributeError, TypeError):
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
