"""Reading and writing config YAML: ``yaml.safe_load``/``safe_dump`` only, duplicate keys refused.

PyYAML keeps the last of two equal keys without a word, so ``lr`` written twice would silently drop
one value; the document is composed (nodes only, nothing constructed) and checked for that first.

Example:
    >>> load_yaml_mapping("epochs: 3\\noptimizer: {lr: 3e-4}")
    {'epochs': 3, 'optimizer': {'lr': '3e-4'}}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from functrain._atomic import replace_text
from functrain.config.errors import ConfigError, Problem

__all__ = ["dump_yaml", "load_yaml_mapping", "read_yaml_source", "write_text_atomic"]


def read_yaml_source(source: str | os.PathLike[str]) -> tuple[str, str]:
    """``(text, where)`` for a path or YAML text; ``where`` names the file for error messages.

    A ``PathLike``, or a one-line string ending in ``.yaml``/``.yml`` or naming an existing file, is a
    path; any other string is YAML text.

    Example:
        >>> read_yaml_source("epochs: 3")
        ('epochs: 3', '<yaml text>')
    """
    is_path = isinstance(source, os.PathLike) or (
        "\n" not in source and (source.endswith((".yaml", ".yml")) or os.path.isfile(source))
    )
    if not is_path:
        return str(source), "<yaml text>"
    path = Path(source)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except FileNotFoundError:
        raise ConfigError.single(str(path), "config file not found", "check the path") from None
    except OSError as exc:
        raise ConfigError.single(str(path), f"cannot read the config file: {exc}", "check the path") from exc


def load_yaml_mapping(text: str, where: str = "<yaml text>") -> dict[str, Any]:
    """Parse YAML ``text`` that must hold a mapping (an empty document is an empty mapping).

    Example:
        >>> load_yaml_mapping("")
        {}
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError.single(
            where, f"invalid YAML: {exc}", "fix the YAML syntax at the line shown"
        ) from exc
    problems = list(_duplicate_keys(node, ""))
    if problems:
        raise ConfigError(problems)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError.single(
            where,
            f"the document is a {type(data).__name__}, not a mapping",
            "write one 'field: value' per line",
        )
    return data


def dump_yaml(data: Any) -> str:
    """YAML text for plain data, keeping the fields in declaration order."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename, so no half-written file remains.

    Example:
        >>> import tempfile, pathlib
        >>> write_text_atomic(pathlib.Path(tempfile.mkdtemp()) / "c.yaml", "epochs: 1\\n").read_text()
        'epochs: 1\\n'
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_text(target, text)
    return target


def _duplicate_keys(node: yaml.Node | None, path: str) -> list[Problem]:
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            child = f"{path}.{key}" if path else str(key)
            if key is not None:
                line = key_node.start_mark.line + 1
                if key in seen:
                    problems.append(
                        Problem(
                            child, f"appears twice (lines {seen[key]} and {line})", "keep only one of them"
                        )
                    )
                seen.setdefault(key, line)
            problems += _duplicate_keys(value_node, child)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{path}[{i}]")
    return problems
