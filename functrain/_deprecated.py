"""Old argument names kept for one release: one warning, one refusal when both names are given.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...     warnings.simplefilter("always")
    ...     renamed_argument("fit", "log_every", 10, "log_steps", 50, default=50)
    10
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["renamed_argument"]


def renamed_argument(
    owner: str, old: str, old_value: Any, new: str, new_value: Any, *, default: Any, stacklevel: int = 3
) -> Any:
    """``new_value``, or ``old_value`` (with a ``DeprecationWarning``) when the old name was given.

    ``old_value`` is ``None`` when the old name was not given. Giving both names (the new one away from
    its ``default``) is a ``TypeError``: which one was meant cannot be guessed. ``stacklevel`` points the
    warning at the caller of ``owner`` (3: the caller of the function that calls this one).
    """
    if old_value is None:
        return new_value
    warnings.warn(
        f"{owner}({old}=...) is deprecated and goes in the next release: use {new}=..., the name "
        "TrainerConfig, the YAML and the CLI use",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    if new_value is not default and new_value != default:
        raise TypeError(f"{owner}: give {new}=... only ({old}= is its deprecated name)")
    return old_value
