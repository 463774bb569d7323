"""functrain.__version__: the installed package's metadata, else the checkout's pyproject.toml."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import functrain as ft
from functrain import _version


def _pyproject_version() -> str:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)


def test_version_is_the_package_metadata():
    assert ft.__version__ == metadata.version("functrain")


def test_a_checkout_without_metadata_reads_pyproject(monkeypatch):
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert _version._version() == _pyproject_version()
