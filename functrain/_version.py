"""functrain's version, from the installed package's metadata (one source of truth: pyproject.toml).

A source checkout that was never installed has no metadata: the version is then read from the
checkout's pyproject.toml, else ``"0+unknown"``.

Example:
    >>> from functrain._version import __version__
    >>> __version__  # doctest: +SKIP
    '0.1.0'
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

__all__ = ["__version__"]


def _version() -> str:
    try:
        return metadata.version("functrain")
    except metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return "0+unknown"
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return match.group(1) if match else "0+unknown"


__version__ = _version()
