"""functrain.compile.lazy_templates: inductor's kernel templates compiled on first use, the same templates."""

from __future__ import annotations

import copy
import importlib
import subprocess
import sys

import pytest

from functrain.compile.lazy_templates import LazyTemplate

backend_module = importlib.import_module("functrain.compile.backend")


def test_a_lazy_template_compiles_on_first_use_and_renders_as_jinjas_own():
    jinja2 = pytest.importorskip("jinja2")
    made = []

    def make(source):
        made.append(source)
        return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(source)

    source = "{% for i in range(n) %}{{ name }}{{ i }};{% endfor %}"
    lazy = LazyTemplate(make, source)
    assert made == []
    assert lazy.render(n=3, name="x") == make(source).render(n=3, name="x") == "x0;x1;x2;"
    assert made == [source, source]  # once for the lazy one (kept), once for the reference
    lazy.render(n=1, name="y")
    assert len(made) == 2
    with pytest.raises(jinja2.UndefinedError):  # jinja's own errors, at render as before
        lazy.render(n=1)


def test_a_copy_does_not_compile_and_renders_the_same():
    jinja2 = pytest.importorskip("jinja2")
    made = []

    def make(source):
        made.append(source)
        return jinja2.Environment().from_string(source)

    lazy = LazyTemplate(make, "{{ x }}!")
    twin = copy.copy(lazy)  # copy's __reduce_ex__/__setstate__ probes are not forwarded
    assert made == []
    assert twin.render(x=2) == lazy.render(x=2) == "2!"


_CHILD = """
import torch
from functrain.compile import lazy_templates
lazy_templates.install()
import torch._inductor.compile_fx
from torch._inductor.codegen.common import KernelTemplate
from torch._inductor.select_algorithm import TritonTemplate
templates = list(TritonTemplate.all_templates.values())
assert templates, "inductor made no TritonTemplate at import"
assert all(isinstance(t.template, lazy_templates.LazyTemplate) and t.template._template is None
           for t in templates), "a template was compiled at import"
t = templates[0].template
reference = KernelTemplate._template_from_string.__wrapped__(t._source)
assert t.template().render is not None and type(t.template()) is type(reference)
print(len(templates))
"""


def test_importing_inductor_compiles_no_template_after_install():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0


def test_jit_installs_it_before_importing_compile_fx(monkeypatch):
    order = []
    monkeypatch.setattr(backend_module.lazy_templates, "install", lambda: order.append("install"))

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        order.append("compile_fx")
        return gm

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    import torch

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    backend_module.compile_graph(gm, [torch.ones(2)], {})
    assert order == ["install", "compile_fx"]
