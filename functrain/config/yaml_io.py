"""Reading and writing config YAML: safe loading only, duplicate keys refused, any input refused cleanly.

Reading is total: whatever bytes a file holds, the result is a mapping or a `ConfigError` naming the
file (and the line and column where YAML gives one), within a fraction of a second for inputs up to a
few MB. The file must be UTF-8 and at most :data:`MAX_BYTES` long, with at most :data:`MAX_NODES` values
(each costs ~1 KB and ~5 us to build; a document that may hold more is counted first, by the parser's
events, which stops at the limit); the document is parsed once, with
libyaml's C parser where PyYAML has it (``yaml.CSafeLoader``, the pure-Python ``SafeLoader`` otherwise);
the node graph is then checked before anything is built from it:

- **duplicate keys** (PyYAML keeps the last of two equal keys without a word, so ``lr`` written twice
  would silently drop one value);
- **nesting deeper than** :data:`MAX_DEPTH` (a config is a few levels deep);
- **aliases**: an alias that contains itself is refused, and aliases may add at most
  :data:`MAX_ALIAS_NODES` nodes to the document once expanded (a "billion laughs" document is 30 lines
  that expand to 10^9 nodes);
- **numbers**: an integer of more than :data:`MAX_NUMBER_CHARS` characters is refused (Python refuses
  to read 4,300 digits, and a float field cannot hold 310).

Example:
    >>> load_yaml_mapping("epochs: 3\\noptimizer: {lr: 3e-4}")
    {'epochs': 3, 'optimizer': {'lr': '3e-4'}}
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import yaml

from functrain.config.errors import ConfigError, Problem
from functrain.core.atomic import replace_text

__all__ = [
    "MAX_ALIAS_NODES",
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_NUMBER_CHARS",
    "dump_yaml",
    "load_yaml",
    "load_yaml_mapping",
    "read_yaml_source",
    "write_text_atomic",
]

MAX_BYTES = 4 * 2**20  # a config file is a few KB; 4 MB is room for long text and comments
MAX_NODES = 50_000  # values (scalars, lists, mappings) in a document: room for long lists of numbers
MAX_DEPTH = 64  # levels of nested mappings and lists
MAX_ALIAS_NODES = 10_000  # nodes that aliases may add to the document, once expanded
MAX_NUMBER_CHARS = 64  # characters of an integer (2**64 has 20 digits)

_INT_TAG = "tag:yaml.org,2002:int"


def read_yaml_source(source: str | os.PathLike[str]) -> tuple[str, str]:
    """``(text, where)`` for a path or YAML text; ``where`` names the file for error messages.

    A ``PathLike``, or a one-line string ending in ``.yaml``/``.yml`` or naming an existing file, is a
    path; any other string is YAML text. A file must be UTF-8 (a UTF-8 byte order mark is allowed) and
    at most :data:`MAX_BYTES` long.

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
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError.single(str(path), "config file not found", "check the path") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError.single(str(path), f"cannot read the config file: {exc}", "check the path") from exc
    if len(data) > MAX_BYTES:
        raise ConfigError.single(
            str(path),
            f"the config file is larger than {MAX_BYTES // 2**20} MB",
            "a config is a few KB: keep data (long lists, tables) in files the config names",
        )
    return _decode(data, str(path)), str(path)


def load_yaml(text: str, where: str = "<yaml text>") -> Any:
    """The plain data of one YAML document (``None`` if empty), parsed once and checked as described in
    the module docstring; any problem is a `ConfigError` naming ``where``.

    Example:
        >>> load_yaml("[&x 1, *x]")
        [1, 1]
    """
    return _load(text, where)[0]


def load_yaml_mapping(text: str, where: str = "<yaml text>") -> dict[str, Any]:
    """Parse YAML ``text`` that must hold a mapping (an empty document is an empty mapping).

    Example:
        >>> load_yaml_mapping("")
        {}
    """
    return load_yaml_mapping_with_lines(text, where)[0]


def load_yaml_mapping_with_lines(
    text: str, where: str = "<yaml text>"
) -> tuple[dict[str, Any], dict[str, int]]:
    """`load_yaml_mapping` and the line of each field path (``"optimizer.lr"``, ``"metrics[1]"``), for
    error messages.

    Example:
        >>> load_yaml_mapping_with_lines("epochs: 3\\noptimizer:\\n  lr: 0.1")[1]
        {'epochs': 1, 'optimizer': 2, 'optimizer.lr': 3}
    """
    data, lines = _load(text, where)
    if data is None:
        return {}, lines
    if not isinstance(data, dict):
        raise ConfigError.single(
            where,
            f"the document is a {type(data).__name__}, not a mapping",
            "write one 'field: value' per line",
        )
    return data, lines


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


def _decode(data: bytes, where: str) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(data) > 1 and b"\x00" in data[:2]):
        raise ConfigError.single(
            where,
            "the config file is UTF-16 (or UTF-32) encoded; it must be UTF-8",
            "save it as UTF-8 (in most editors: 'Save with encoding' -> UTF-8)",
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError.single(
            where,
            f"the config file is not UTF-8: byte 0x{data[exc.start]:02x} at line {line}, column {column} "
            f"({exc.reason})",
            'save it as UTF-8, and write non-ASCII text as UTF-8 or as YAML escapes in double quotes ("\\xe9")',
        ) from None


def _make_loader(base: type) -> type:
    """The safe loader ``base`` whose scalar conversions (``!!int abc``, ``2001-13-45``) fail as YAML errors
    with their position, not as ``ValueError``/``KeyError``."""

    class Loader(base):  # type: ignore[misc, valid-type]
        def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
            try:
                return super().construct_object(node, deep=deep)
            except yaml.YAMLError:
                raise
            except Exception as exc:
                raise yaml.MarkedYAMLError(
                    problem=f"cannot read the value {_short(node)}: {type(exc).__name__}: {exc}",
                    problem_mark=node.start_mark,
                ) from exc

    return Loader


_Loader = _make_loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml's C parser where available


def _load(text: str, where: str) -> tuple[Any, dict[str, int]]:
    if _most_nodes(text) > MAX_NODES and _count_nodes(text, MAX_NODES) > MAX_NODES:
        raise ConfigError.single(
            where,
            f"the document holds more than {MAX_NODES:,} values",
            "a config is a few hundred values: keep data (long lists, tables) in files the config names",
        )
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            lines: dict[str, int] = {}
            if node is not None:
                problems = _check_graph(node, lines)
                if problems:
                    raise ConfigError(problems, source=where)
            data = None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError.single(
            where, f"invalid YAML: {_one_line(exc)}", "fix the YAML syntax at the line shown"
        ) from None
    except RecursionError:  # the pure-Python parser on deep nesting (libyaml stops at 1000 levels itself)
        raise ConfigError.single(
            where, f"the YAML is nested more than {MAX_DEPTH} levels deep", "flatten the document"
        ) from None
    except UnicodeError as exc:  # a lone surrogate in a Python string given as YAML text
        raise ConfigError.single(where, f"the YAML text cannot be encoded: {exc}", "use valid text") from None
    return data, lines


def _most_nodes(text: str) -> int:
    """An upper bound on the nodes of ``text``: each node after the first follows an indicator (``,``,
    ``:``, ``-``, ``?``, ``[``, ``{``) or a line break. Cheap (``str.count``), so exact counting is only
    needed for large documents."""
    return 2 * sum(text.count(c) for c in ",:-?[{\n") + 2


def _count_nodes(text: str, limit: int) -> int:
    """The nodes of ``text`` counted by the parser's events (no nodes built), stopping past ``limit``;
    a syntax error ends the count (the parse that follows reports it)."""
    loader = _Loader(text)
    count = 0
    try:
        while count <= limit and loader.check_event():
            if isinstance(loader.get_event(), _NODE_EVENTS):
                count += 1
    except (yaml.YAMLError, UnicodeError):
        pass
    finally:
        loader.dispose()
    return count


_NODE_EVENTS = (yaml.ScalarEvent, yaml.AliasEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)


def _check_graph(root: yaml.Node, lines: dict[str, int]) -> list[Problem]:
    """Problems of the node graph (duplicate keys, depth, self-containing aliases, alias expansion,
    long integers), found by one walk over each distinct node; ``lines`` is filled with field paths."""
    size: dict[int, int] = {}  # id(node) -> nodes in its expansion, once walked
    active: set[int] = set()  # the nodes on the current path (an alias to one of them is a cycle)
    problems: list[Problem] = []
    distinct = 0

    def walk(node: yaml.Node, path: str, depth: int) -> int:
        nonlocal distinct
        key = id(node)
        if key in size:  # a second reference: an alias, already checked
            return size[key]
        where = path or "<document>"
        line = node.start_mark.line + 1
        if key in active:
            problems.append(Problem(where, "an alias (*name) contains itself", "remove the alias", line))
            raise _Stop
        if depth > MAX_DEPTH:
            problems.append(
                Problem(where, f"nested more than {MAX_DEPTH} levels deep", "flatten the document", line)
            )
            raise _Stop
        distinct += 1
        total = 1
        active.add(key)
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
                child = f"{path}.{name}" if path else str(name)
                if name is not None:
                    key_line = key_node.start_mark.line + 1
                    if name in seen:
                        problems.append(
                            Problem(
                                child,
                                f"appears twice (lines {seen[name]} and {key_line})",
                                "keep only one of them",
                            )
                        )
                    seen.setdefault(name, key_line)
                    lines.setdefault(child, key_line)
                total += walk(key_node, child, depth + 1) + walk(value_node, child, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                child = f"{path}[{i}]"
                lines.setdefault(child, item.start_mark.line + 1)
                total += walk(item, child, depth + 1)
        elif node.tag == _INT_TAG and len(node.value) > MAX_NUMBER_CHARS:
            problems.append(
                Problem(
                    where,
                    f"the integer has {len(node.value)} characters, more than {MAX_NUMBER_CHARS}",
                    "write a number in range, or quote it if it is text",
                    line,
                )
            )
        active.discard(key)
        size[key] = total
        if total - distinct > MAX_ALIAS_NODES:
            problems.append(
                Problem(
                    where,
                    f"aliases (*name) expand the document to more than {total:,} nodes",
                    f"use aliases that add at most {MAX_ALIAS_NODES:,} nodes",
                    line,
                )
            )
            raise _Stop
        return total

    with contextlib.suppress(_Stop):
        walk(root, "", 0)
    return problems


class _Stop(Exception):
    """Ends the walk after a problem that makes the rest of the graph meaningless to walk."""


def _short(node: yaml.Node) -> str:
    value = str(node.value)
    return repr(value if len(value) <= 40 else value[:37] + "...")


def _one_line(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: what, and where (line and column)."""
    return " ".join(str(exc).split()).replace('in "<unicode string>", ', "at ")
