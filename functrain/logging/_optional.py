"""Import an optional dependency, or raise an ImportError that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_optional(module: str, extra: str, who: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError saying ``pip install "functrain[extra]"``.

    Example:
        >>> import_optional("json", "none", "example").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f'{who} needs the {module} package: pip install "functrain[{extra}]" (or pip install {module})'
        ) from err
