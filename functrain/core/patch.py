"""Set attributes for the length of a block and put back exactly what was there (or nothing).

Example:
    >>> import types
    >>> box = types.SimpleNamespace(x=1)
    >>> with patched([(box, "x", 2), (box, "y", 3)]):
    ...     (box.x, box.y)
    (2, 3)
    >>> (box.x, hasattr(box, "y"))
    (1, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["patched"]

_ABSENT = object()


@contextlib.contextmanager
def patched(changes: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set ``setattr(obj, name, value)`` for each ``(obj, name, value)``; on exit restore each object's
    own attribute as it was (instance ``__dict__``), deleting the ones that did not exist."""
    changes = list(changes)
    saved = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name, _ in changes]
    for obj, name, value in changes:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
