"""Import specs: how a config file names a Python object (a model, a dataset) to build.

A spec is either

- a string ``"package.module:attr"`` (``attr`` may be dotted, ``"torch.nn:functional.relu"``): the
  object itself, not called; or
- a mapping ``{"target": "package.module:attr", "args": [...], "kwargs": {...}}``: the object called
  with ``*args, **kwargs`` (both optional; a mapping spec is always called, with no arguments if none
  are given). Nested specs inside ``args``/``kwargs`` are *not* resolved: write a factory function.

Validating a config imports the module and looks the attribute up (so a typo fails before training),
but only :func:`resolve_object` calls it. :func:`build_object` is what the ``functrain`` command does
for the objects a run needs (model, datasets): the string form naming a **class or a function** calls
it with no arguments too (``model: mytask:Net``, ``train_dataset: mytask:load_train``); any other object
(an instance, a list) is used as it is. Give arguments with the mapping form.

**Import specs run code.** Naming ``os:system`` runs a shell command, and importing a module runs its
top-level code; validating a config already imports the modules it names. A config file with import
specs must be trusted like a Python script. ``FUNCTRAIN_ALLOWED_MODULES`` (comma-separated module names,
e.g. ``mytask,torch.nn,torchvision``) narrows which modules a spec may name (those and their
submodules; only public attributes, of objects defined there); it is a guard against a config naming
something unexpected, not a sandbox: an allowed module's code runs with all of the process's rights.

The object a run builds is checked: ``model`` must be an ``nn.Module``, a dataset something a
``DataLoader`` can read (it has ``__getitem__`` or ``__iter__``). An exception raised while building
names the user's own file and line.

Where modules are found: ``sys.path``; the ``functrain`` command first adds the config file's
directory and the current directory (:func:`add_import_dirs`), so ``mytask.py`` beside ``run.yaml``
imports without ``PYTHONPATH``.

Example:
    >>> resolve_object({"target": "torch.nn:Linear", "args": [4, 2], "kwargs": {"bias": False}})
    Linear(in_features=4, out_features=2, bias=False)
    >>> resolve_object("math:pi")
    3.141592653589793
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import os
import pkgutil
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from functrain.config.errors import ConfigError, Problem, suggestion

__all__ = [
    "ALLOWED_MODULES_ENV",
    "ImportSpec",
    "add_import_dirs",
    "allowed_modules",
    "build_object",
    "check_import_spec",
    "deferred_imports",
    "expect_dataset",
    "expect_module",
    "imports_deferred",
    "normalize_import_spec",
    "resolve_object",
]

ImportSpec = str | dict[str, Any]

_SPEC_KEYS = ("target", "args", "kwargs")
_FORM = "write 'package.module:attr' or {target: 'package.module:attr', args: [...], kwargs: {...}}"
_ADDED_DIRS: list[tuple[str, str]] = []  # (what, directory) put on sys.path by add_import_dirs
ALLOWED_MODULES_ENV = "FUNCTRAIN_ALLOWED_MODULES"
_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("functrain_imports_deferred", default=False)


@contextlib.contextmanager
def deferred_imports() -> Iterator[None]:
    """Within the block, validating a config checks import specs' form only and imports nothing (no
    user module, no torch): what the ``functrain`` command checks before its slow imports. The imports
    are checked when the config is validated again, or the objects built, outside the block.

    Example:
        >>> from functrain.config import TrainerConfig
        >>> with deferred_imports():
        ...     TrainerConfig(epochs=1, model="not_installed_yet:Net").model
        'not_installed_yet:Net'
    """
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def imports_deferred() -> bool:
    """Whether validation runs inside :func:`deferred_imports` (import nothing, check forms only)."""
    return _DEFERRED.get()


def add_import_dirs(dirs: dict[str, str | os.PathLike[str]]) -> None:
    """Put directories at the front of ``sys.path`` (first given, first searched) for import specs.

    ``dirs`` maps a description (``"the config's directory"``) to a directory; a missing-module error
    then lists them. They stay on the path for the process, so data-loader workers import the same
    modules.

    Example:
        >>> add_import_dirs({"the current directory": "."})  # doctest: +SKIP
    """
    for what, directory in reversed(list(dirs.items())):
        directory = os.path.abspath(directory)
        if directory in sys.path:
            sys.path.remove(directory)
        sys.path.insert(0, directory)
        _ADDED_DIRS[:] = [(w, d) for w, d in _ADDED_DIRS if d != directory]
        _ADDED_DIRS.insert(0, (what, directory))


def normalize_import_spec(spec: Any, path: str = "spec") -> ImportSpec:
    """Check a spec's shape (not whether it imports) and return it as plain data (tuples become lists).

    Example:
        >>> normalize_import_spec({"target": "torch.nn:Linear", "args": (4, 2)})
        {'target': 'torch.nn:Linear', 'args': [4, 2]}
    """
    if isinstance(spec, str):
        _split_target(spec, path)
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError.single(
            path, f"an import spec must be a string or a mapping, got {type(spec).__name__}", _FORM
        )
    problems = []
    for key in spec:
        if key not in _SPEC_KEYS:
            hint = suggestion(str(key), _SPEC_KEYS) or f"the keys are {', '.join(_SPEC_KEYS)}"
            problems.append(Problem(f"{path}.{key}", "unknown import spec key", hint))
    if "target" not in spec:
        problems.append(Problem(f"{path}.target", "missing", _FORM))
    elif not isinstance(spec["target"], str):
        problems.append(Problem(f"{path}.target", "must be a string 'package.module:attr'", _FORM))
    else:
        try:
            _split_target(spec["target"], f"{path}.target")
        except ConfigError as err:
            problems += err.problems
    args = spec.get("args", [])
    if not isinstance(args, (list, tuple)):
        problems.append(
            Problem(f"{path}.args", f"must be a list, got {type(args).__name__}", "write args: [a, b]")
        )
    kwargs = spec.get("kwargs", {})
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        problems.append(
            Problem(f"{path}.kwargs", "must be a mapping with string keys", "write kwargs: {name: value}")
        )
    if problems:
        raise ConfigError(problems)
    out: dict[str, Any] = {"target": spec["target"]}
    if "args" in spec:
        out["args"] = list(args)
    if "kwargs" in spec:
        out["kwargs"] = dict(kwargs)
    return out


def check_import_spec(spec: ImportSpec, path: str = "spec") -> Any:
    """Import the spec's module and look its attribute up, without calling it; returns the attribute.

    Example:
        >>> check_import_spec("torch.nn:Linear").__name__
        'Linear'
    """
    spec = normalize_import_spec(spec, path)
    target = spec if isinstance(spec, str) else spec["target"]
    where = path if isinstance(spec, str) else f"{path}.target"
    module_name, attr = _split_target(target, where)
    allowed = allowed_modules()
    if allowed is not None:
        _check_allowed(target, module_name, attr, allowed, where)
    module = _import_module(module_name, target, where)
    obj: Any = module
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = suggestion(part, names) or f"check the spelling; {walked} has no attribute {part!r}"
            raise ConfigError.single(where, f"{target!r}: {walked} has no attribute {part!r}", hint)
        obj = getattr(obj, part)
        walked = f"{walked}.{part}"
    defined_in = getattr(obj, "__module__", None)
    if allowed is not None and isinstance(defined_in, str) and not _within(defined_in, allowed):
        raise ConfigError.single(
            where,
            f"{target!r} is defined in {defined_in!r}, which is not in {ALLOWED_MODULES_ENV} ({', '.join(allowed)})",
            f"name it from its own module, and add that module to {ALLOWED_MODULES_ENV} if you trust it",
        )
    return obj


def allowed_modules() -> list[str] | None:
    """The modules listed in ``FUNCTRAIN_ALLOWED_MODULES`` (comma-separated), or ``None`` when it is unset
    (every module allowed).

    Example:
        >>> os.environ[ALLOWED_MODULES_ENV] = "mytask, torch.nn"
        >>> allowed_modules()
        ['mytask', 'torch.nn']
        >>> del os.environ[ALLOWED_MODULES_ENV]
    """
    value = os.environ.get(ALLOWED_MODULES_ENV)
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _within(module_name: str, allowed: list[str]) -> bool:
    return any(module_name == a or module_name.startswith(a + ".") for a in allowed)


def _check_allowed(target: str, module_name: str, attr: str, allowed: list[str], where: str) -> None:
    if not _within(module_name, allowed):
        raise ConfigError.single(
            where,
            f"{target!r}: the module {module_name!r} is not in {ALLOWED_MODULES_ENV} ({', '.join(allowed) or 'empty'})",
            f"add {module_name} to {ALLOWED_MODULES_ENV} if you trust its code, or name an allowed module",
        )
    private = [part for part in attr.split(".") if part.startswith("_")]
    if private:
        raise ConfigError.single(
            where,
            f"{target!r}: the attribute {private[0]!r} is private, refused with {ALLOWED_MODULES_ENV} set",
            "name a public attribute",
        )


def resolve_object(spec: ImportSpec, *, path: str = "spec") -> Any:
    """The object a spec names: imported, and called with ``args``/``kwargs`` when the spec is a mapping.

    Errors name ``path`` (the config field holding the spec) and the spec: a missing module (with close
    module names), a missing attribute (with close names from the module), or a call that raised.

    Example:
        >>> resolve_object({"target": "fractions:Fraction", "args": [1, 3]})
        Fraction(1, 3)
    """
    obj = check_import_spec(spec, path)
    if isinstance(spec, str):
        return obj
    spec = normalize_import_spec(spec, path)
    args, kwargs = spec.get("args", []), spec.get("kwargs", {})
    if not callable(obj):
        raise ConfigError.single(
            path,
            f"{spec['target']!r} is a {type(obj).__name__}, which cannot be called",
            "use the string form 'package.module:attr' to get the object without calling it",
        )
    try:
        return obj(*args, **kwargs)
    except Exception as exc:
        raise ConfigError.single(
            path,
            f"calling {spec['target']!r} with args={args!r} kwargs={kwargs!r} raised {type(exc).__name__}: "
            f"{exc}{_raised_at(exc)}",
            "fix the arguments in the spec (or the code it calls); the original traceback is chained to this error",
        ) from exc


def build_object(
    spec: ImportSpec, *, path: str = "spec", expect: Callable[[Any], str | None] | None = None
) -> Any:
    """The object a run needs (a model, a dataset) from its spec: a string spec naming a class or a
    function is called with no arguments, as the mapping form calls its target; any other object is used
    as it is (an ``nn.Module`` instance is not called).

    The result is checked with ``expect`` (``None`` if fine, else what was expected), by default the
    check of the `TrainerConfig` field ``path`` names: ``model`` an ``nn.Module`` (`expect_module`),
    ``train_dataset``/``eval_dataset``/``test_dataset`` a dataset (`expect_dataset`).

    Example:
        >>> build_object("collections:OrderedDict")
        OrderedDict()
        >>> build_object("math:pi")
        3.141592653589793
    """
    check = _EXPECTED.get(path) if expect is None else expect
    if not isinstance(spec, str):
        built = resolve_object(spec, path=path)
        target, called = spec["target"], True
    else:
        obj = check_import_spec(spec, path)
        target, called = spec, inspect.isclass(obj) or inspect.isroutine(obj)
        if not called:
            built = obj
        else:
            try:
                built = obj()
            except Exception as exc:
                raise ConfigError.single(
                    path,
                    f"{spec!r} names a {'class' if inspect.isclass(obj) else 'function'}, called with no "
                    f"arguments, which raised {type(exc).__name__}: {exc}{_raised_at(exc)}",
                    f"give its arguments: {path}: {{target: {spec!r}, args: [...], kwargs: {{...}}}}; the "
                    "original traceback is chained to this error",
                ) from exc
    expected = None if check is None else check(built)
    if expected is not None:
        what = f"built {target.replace(':', '.')}(...) returned" if called else f"{target!r} is"
        raise ConfigError.single(
            path,
            f"{what} {type(built).__name__}, expected {expected}",
            f"name a class or function that gives {expected}",
        )
    return built


def expect_module(obj: Any) -> str | None:
    """``None`` if ``obj`` is an ``nn.Module``, else what was expected (for `build_object`'s ``expect``)."""
    import torch

    return None if isinstance(obj, torch.nn.Module) else "an nn.Module"


def expect_dataset(obj: Any) -> str | None:
    """``None`` if a ``DataLoader`` can read ``obj`` (it has ``__getitem__`` or ``__iter__``; not text or a
    number), else what was expected."""
    readable = hasattr(obj, "__getitem__") or hasattr(obj, "__iter__")
    if readable and not isinstance(obj, (str, bytes, Mapping)):
        return None
    return "a dataset (an object with __getitem__ and __len__, or __iter__)"


_EXPECTED: dict[str, Callable[[Any], str | None]] = {
    "model": expect_module,
    "train_dataset": expect_dataset,
    "eval_dataset": expect_dataset,
    "test_dataset": expect_dataset,
}


def _raised_at(exc: BaseException) -> str:
    """`` (at FILE:LINE, in FUNC)``: the innermost frame of the traceback in the user's code (not in
    functrain, the standard library or an installed package), or an empty string."""
    library = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    library |= {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    library = {os.path.realpath(p) + os.sep for p in library}
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        filename = os.path.realpath(frame.filename)
        if not frame.filename.startswith("<") and not any(filename.startswith(p) for p in library):
            return f" (at {frame.filename}:{frame.lineno}, in {frame.name})"
    return ""


def _split_target(target: str, path: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        guess = ""
        if not sep and "." in target:
            head, _, tail = target.rpartition(".")
            guess = f" (probably {head}:{tail!s})"
        raise ConfigError.single(path, f"{target!r} is not of the form 'package.module:attr'", _FORM + guess)
    return module_name, attr


def _import_module(module_name: str, target: str, path: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name != missing and not module_name.startswith(missing + "."):
            # The module exists but one of *its* imports is missing: a dependency problem, not a typo.
            raise ConfigError.single(
                path, f"importing {module_name!r} failed: {exc}", f"install the missing package {missing!r}"
            ) from exc
        hint = suggestion(missing.rpartition(".")[2], _sibling_modules(missing))
        searched = ""
        if "." not in missing:
            places = [f"{what} ({d})" for what, d in _ADDED_DIRS] + [
                "sys.path (installed packages, PYTHONPATH)"
            ]
            searched = f" (searched {', '.join(places)})"
        raise ConfigError.single(
            path,
            f"{target!r}: no module named {missing!r}{searched}",
            hint
            or f"put {missing}.py (or the package {missing}/) in one of those directories, install its package, "
            "or add its directory to PYTHONPATH",
        ) from exc
    except Exception as exc:
        raise ConfigError.single(
            path,
            f"importing {module_name!r} raised {type(exc).__name__}: {exc}",
            "fix the error in that module",
        ) from exc


def _sibling_modules(missing: str) -> list[str]:
    """Module names next to ``missing``: in its parent package, or top-level ones."""
    parent, _, _ = missing.rpartition(".")
    if not parent:
        return sorted(set(sys.builtin_module_names) | {m.name for m in pkgutil.iter_modules()})
    try:
        package = importlib.import_module(parent)
    except Exception:
        return []
    return [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
