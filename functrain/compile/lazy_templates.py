"""Inductor's kernel templates compiled by jinja when first used, not when inductor is imported.

Every process that compiles a step or loads a cached one imports ``torch._inductor.compile_fx``, which
imports inductor's GPU kernel modules (matmul, convolution, flex attention): each builds its
``TritonTemplate`` at import, and jinja compiles the ~20 templates' sources there, 0.2-0.3 s of CPU of a
warm start on the 2-core machine (benchmarks/README.md, warm start), for templates a CPU step never
renders. :func:`install` makes ``KernelTemplate._template_from_string`` return a :class:`LazyTemplate`,
which compiles its source with inductor's own function on the first attribute use (``render``, ...):
the same template, made later. Install it before ``compile_fx`` is first imported; templates made
earlier stay as they are. A torch without that function keeps its own.

Example:
    >>> install()  # before the first import of torch._inductor.compile_fx  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LazyTemplate", "install"]

_installed = False


class LazyTemplate:
    """A jinja template made by ``make(source)`` on its first attribute use (``render``, ``module``...).

    Example:
        >>> import jinja2
        >>> t = LazyTemplate(jinja2.Environment().from_string, "{{ x }}!")
        >>> t.render(x=1)
        '1!'
    """

    __slots__ = ("_make", "_source", "_template")

    def __init__(self, make: Callable[[str], Any], source: str) -> None:
        self._make = make
        self._source = source
        self._template: Any = None

    def template(self) -> Any:
        """The compiled template (compiled now if not yet)."""
        if self._template is None:
            self._template = self._make(self._source)
        return self._template

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle probes: never compile (nor recurse before __init__)
            raise AttributeError(name)
        return getattr(self.template(), name)


def install() -> None:
    """Make inductor's ``KernelTemplate._template_from_string`` lazy (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch._inductor.codegen.common import KernelTemplate, jinja2_env
    except ImportError:  # a private torch API moved: inductor's own way
        return
    original = KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(original, staticmethod):
        return
    make = original.__func__

    def _template_from_string(source: str) -> Any:
        if jinja2_env() is None:  # no jinja2: inductor's None
            return None
        return LazyTemplate(make, source)

    _template_from_string.__wrapped__ = make  # type: ignore[attr-defined]
    KernelTemplate._template_from_string = staticmethod(_template_from_string)  # type: ignore[method-assign]
