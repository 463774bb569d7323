"""The filter that skips dynamo's guards on library globals (``torch.compile(options={"guard_filter_fn": ...})``).

Example:
    >>> entry = types.SimpleNamespace(name="G['__import_functrain_dot_tree'].leaves.__code__")
    >>> skip_library_guards([entry])  # a guard on functrain's own code: skipped
    [False]
"""

from __future__ import annotations

import re
import sys
import types
from typing import Any

from functrain.compile import wrappers

__all__ = ["skip_library_guards"]

# Dynamo guards every global the trace read. Those that stay inside the code a functrain step runs
# through (functrain's own modules, torch's functional_call/functorch/pytree internals, optree, dataclasses,
# builtins: ~700 of the ~1300 guards of a 100-leaf step) fail only if that library code itself is
# monkeypatched during a run; evaluating them cost ~60 us per call here (benchmarks/README.md,
# "Per-call overhead"). They are skipped. A guard whose path leaves the library through a module
# attribute (``functrain.step``'s ``nn.functional.gelu`` is ``torch.nn.functional.gelu``, which a user
# may patch), and every guard on the globals of the user's modules or of ``torch.nn``'s, is kept:
# changing one still recompiles the step.
#
# The pytree registries (torch's ``SUPPORTED_NODES``, optree's ``_NODETYPE_REGISTRY``) are library data
# too: dynamo guards their keys (``len(__import__('torch').utils._pytree.SUPPORTED_NODES) != 115``),
# so any node type registered after the first call (a lazily imported module defining a
# ``functrain.tree.struct``: ``ft.evaluate`` imports ``functrain.loop``; a Hugging Face model module
# registering its ``ModelOutput`` classes) recompiled every step. The types a step flattens are
# registered before the state that holds them exists, and each input's type is still guarded; a node
# type registered later is one the step never saw.
_LIBRARY_MODULES = re.compile(
    r"(functrain|dataclasses|contextlib|functools|math|optree|torch\._functorch|torch\._dynamo"
    r"|torch\.utils\._pytree|torch\.nn\.utils\.(stateless|_named_member_accessor))(\..+)?"
)
# A guard's roots: a global of the traced function's module (``G['__import_functrain_dot_tree']``,
# ``G['torch_pytree']``) or a module dynamo imports by name (``__import__('torch')``), each with the
# attributes that follow; wrappers around them (``list(dict.keys(...))[3]``, ``type(...)``) read the same
# objects.
_ROOT_PATH = re.compile(r"G\['([^']+)'\]((?:\.\w+)*)|__import__\('([\w.]+)'\)((?:\.\w+)*)")
_MISSING = object()


def _is_library_path(name: str) -> bool:
    """Whether every root of a guard's source (``G['__import_functrain_dot_tree'].leaves.__code__``,
    ``list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[3]``) starts at a library
    module (or a global of jit's wrappers) and reaches no other module on its way; a local (``L[...]``)
    anywhere in it keeps the guard."""
    roots = list(_ROOT_PATH.finditer(name))
    return bool(roots) and "L[" not in name and all(_is_library_root(*root.groups()) for root in roots)


def _is_library_root(global_name: str | None, attrs: str, module_name: str | None, import_attrs: str) -> bool:
    if module_name is not None:  # __import__('torch').utils._pytree...: start at the named submodule
        return _library_attrs(*_submodule(module_name, import_attrs.split(".")[1:]))
    if global_name.startswith("__builtins_dict___"):
        return True
    if global_name.startswith("__import_"):
        module_name = global_name[len("__import_") :].replace("_dot_", ".")
        obj = sys.modules.get(module_name, _MISSING) if _LIBRARY_MODULES.fullmatch(module_name) else _MISSING
    else:  # a global of the module where dynamo starts: jit's wrappers (functrain.compile.wrappers)
        obj = vars(wrappers).get(global_name, _MISSING)
    return _library_attrs(obj, attrs.split(".")[1:])


def _submodule(module_name: str, attrs: list[str]) -> tuple[Any, list[str]]:
    """``__import__(module_name)`` followed by ``attrs``: the deepest module reached under its own name
    (``torch.utils._pytree`` for ``torch`` + ``utils._pytree``; a module aliased elsewhere stops there),
    with the attributes left. A root that is not a library module resolves to nothing (kept)."""
    obj = sys.modules.get(module_name, _MISSING)
    while attrs and isinstance(getattr(obj, attrs[0], None), types.ModuleType):
        child = getattr(obj, attrs[0])
        if child.__name__ != f"{module_name}.{attrs[0]}":
            break
        obj, module_name, attrs = child, child.__name__, attrs[1:]
    return (obj if _LIBRARY_MODULES.fullmatch(module_name) else _MISSING), attrs


def _library_attrs(obj: Any, attrs: list[str]) -> bool:
    for attr in attrs:
        if _outside_library(obj):
            return False
        obj = getattr(obj, attr, _MISSING)
    return not _outside_library(obj)


def _outside_library(obj: Any) -> bool:
    """Missing, or a module that is not library code (a path through it may reach what users patch)."""
    return obj is _MISSING or (
        isinstance(obj, types.ModuleType) and not _LIBRARY_MODULES.fullmatch(obj.__name__)
    )


def skip_library_guards(entries: list[Any]) -> list[bool]:
    """dynamo's ``guard_filter_fn``: keep every guard but those on library globals (see above)."""
    return [not _is_library_path(entry.name) for entry in entries]
