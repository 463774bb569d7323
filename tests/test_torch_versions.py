"""The declared torch range (pyproject's ``torch>=``) against the version workarounds, and the pieces
that make a compiled step trace on every supported torch (CI runs this file on the oldest and newest)."""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as torch_pytree

from functrain import tree
from functrain.jit import TORCH_WORKAROUNDS, torch_version

# The module, not the function `functrain.jit` that the package exports under the same name.
jit_module = importlib.import_module("functrain.jit")
backend_module = importlib.import_module("functrain.compile.backend")  # where jit's inductor options are made


def declared_floor() -> tuple[int, int]:
    """The ``(major, minor)`` of pyproject.toml's ``torch>=X.Y`` requirement."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (requirement,) = [r for r in project["dependencies"] if re.match(r"torch\s*[<>=!~]", r)]
    match = re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)(\.\d+)?", requirement.strip())
    assert match, f"pyproject.toml: expected torch>=X.Y, got {requirement!r}"
    return int(match.group(1)), int(match.group(2))


def test_no_workaround_is_left_for_versions_below_the_floor():
    floor = declared_floor()
    for workaround in TORCH_WORKAROUNDS:
        assert workaround.first <= workaround.last, workaround
        assert workaround.last >= floor, (
            f"{workaround.where}: the workaround for torch {workaround.first}-{workaround.last} is older "
            f"than the declared floor torch>={floor}; remove it ({workaround.remove})"
        )
        assert workaround.symptom and workaround.remove


ROOT = Path(__file__).parents[1]


def _nox() -> dict[str, object]:
    """noxfile.py's module-level constants (NEWEST, FULL, TORCH_VERSIONS, FLOOR_TESTS), read without nox."""
    constants: dict[str, object] = {}

    def value(node: ast.expr) -> object:
        if isinstance(node, ast.Name):
            return constants[node.id]
        if isinstance(node, ast.List):
            return [value(element) for element in node.elts]
        return ast.literal_eval(node)

    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError, KeyError):  # an f-string, nox's own names
                constants[node.targets[0].id] = value(node.value)
    return constants


def _ci() -> dict[str, list[str]]:
    """.ci/run's shell variables: ``NAME=value`` and ``NAME=(a b ...)`` (arrays may span lines)."""
    text = (ROOT / ".ci" / "run").read_text()
    found = {name: value.split() for name, value in re.findall(r"^(\w+)=\(([^)]*)\)", text, re.MULTILINE)}
    found.update({name: [value] for name, value in re.findall(r"^(\w+)=([^(\s]\S*)$", text, re.MULTILINE)})
    return found


def test_ci_and_nox_test_the_declared_floor():
    (ci_floor,) = _ci()["FLOOR"]
    oldest_in_nox = _nox()["TORCH_VERSIONS"][-1]
    assert torch_version(ci_floor) == declared_floor() == torch_version(oldest_in_nox)


def test_ci_and_nox_agree_on_the_versions_and_the_compile_tests():
    nox, ci = _nox(), _ci()
    versions = nox["TORCH_VERSIONS"]
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))), reverse=True)
    assert versions[0] == nox["NEWEST"] == ci["NEWEST_CANDIDATES"][0], "newest first, the same in both"
    assert set(ci["NEWEST_CANDIDATES"]) <= set(versions) and ci["NEWEST_CANDIDATES"] == sorted(
        ci["NEWEST_CANDIDATES"], key=versions.index
    )
    assert ci["FULL"] == [nox["FULL"]] and nox["FULL"] in versions
    assert ci["FLOOR_TESTS"] == nox["FLOOR_TESTS"]
    for pattern in nox["FLOOR_TESTS"]:
        assert list(ROOT.glob(pattern)), f"FLOOR_TESTS: {pattern} matches no file"


def test_workarounds_are_for_supported_versions():
    newest = torch_version(_nox()["NEWEST"])
    for workaround in TORCH_WORKAROUNDS:
        assert workaround.first <= newest, (
            f"{workaround.where}: a workaround for torch {workaround.first}, newer than the newest "
            f"supported {newest}: add that torch to noxfile.py's TORCH_VERSIONS and .ci/run first"
        )


def test_installed_torch_is_inside_the_declared_range():
    assert torch_version() >= declared_floor()


def test_torch_version_reads_release_local_and_dev_builds():
    assert torch_version("2.11.0+cu130") == (2, 11)
    assert torch_version("2.13.0") == (2, 13)
    assert torch_version("2.12.0a0+git1234") == (2, 12)
    with pytest.raises(ValueError, match="torch version"):
        torch_version("nightly")


_OFF = {"loop_ordering_after_fusion": False}


@pytest.mark.parametrize(
    ("version", "expected"), [((2, 10), _OFF), ((2, 11), _OFF), ((2, 12), {}), ((2, 13), {})]
)
def test_loop_ordering_after_fusion_is_off_only_on_torch_2_10_and_2_11(version, expected):
    assert backend_module._workaround_options(version) == expected


def _patches_seen_by_inductor(monkeypatch, version, device, options=None):
    """The config_patches jit's backend hands to inductor for a one-op graph on ``device``."""
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        seen.update(config_patches or {})
        return gm

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    monkeypatch.setattr(backend_module, "torch_version", lambda: version)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    x = torch.ones(2, device="meta") if device == "meta" else torch.ones(2)
    step = jit_module.CompiledStep(lambda s, x: (s, x), options=options)
    step._backend(gm, [x], config=dict(options or {}))
    return seen


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_jit_applies_the_workaround_by_version_and_options_win(monkeypatch, device):
    assert _patches_seen_by_inductor(monkeypatch, (2, 11), device)["loop_ordering_after_fusion"] is False
    assert "loop_ordering_after_fusion" not in _patches_seen_by_inductor(monkeypatch, (2, 12), device)
    mine = _patches_seen_by_inductor(
        monkeypatch, (2, 11), device, options={"loop_ordering_after_fusion": True}
    )
    assert mine["loop_ordering_after_fusion"] is True


# ------------------------------------------------------------------------------------ same_structure


@tree.struct
class _Node:
    x: torch.Tensor
    fn: object = tree.field(static=True, default=None)
    name: str = tree.field(static=True, default="a")


_Pair = namedtuple("_Pair", "a b")


def _first(x):
    return x


def _second(x):
    return x


def _pairs(x):
    """Tree pairs with the same and with different structures (keys, containers, static fields, None)."""
    return [
        ({"w": x, "b": (x, x)}, {"w": x * 2, "b": (x, x)}),
        ({"w": x, "b": (x, x)}, {"w": x, "c": (x, x)}),
        ({"w": x, "b": (x, x)}, {"w": x, "b": [x, x]}),
        ({"w": x, "b": (x, x)}, {"w": x, "b": (x, x, x)}),
        (_Node(x, _first), _Node(x + 1, _first)),
        (_Node(x, _first), _Node(x, _second)),
        (_Node(x, _first, "a"), _Node(x, _first, "b")),
        (_Pair(x, x), (x, x)),
        ({"w": x, "n": None}, {"w": x, "n": x}),
        ((x, {"a": x}), (x, {"a": x})),
    ]


def _compare_all(x):
    optree_results = [tree.same_structure(tree.structure(a), tree.structure(b)) for a, b in _pairs(x)]
    torch_results = [
        tree.same_structure(torch_pytree.tree_flatten(a)[1], torch_pytree.tree_flatten(b)[1])
        for a, b in _pairs(x)
    ]
    return x + 1, optree_results, torch_results


def test_same_structure_is_the_libraries_equality_eagerly():
    _, optree_results, torch_results = _compare_all(torch.ones(2))
    assert optree_results == [tree.structure(a) == tree.structure(b) for a, b in _pairs(torch.ones(2))]
    assert optree_results == [True, False, False, False, True, False, False, False, False, True]
    # torch's pytree treats None as a leaf: {"n": None} and {"n": x} have the same structure there.
    assert torch_results == [True, False, False, False, True, False, False, False, True, True]


@pytest.mark.compile
def test_same_structure_traces_and_agrees_with_eager():
    # optree's `spec != other` inside a compiled step fails on torch 2.10-2.12 ("Polyfill handler
    # <method-wrapper '__eq__' of function object> does not have a traceable function").
    x = torch.ones(2)
    compiled = torch.compile(_compare_all, fullgraph=True, backend="eager")(x)
    assert compiled[1:] == _compare_all(x)[1:]


def _flat_dict_comparisons(x: torch.Tensor) -> tuple[bool, ...]:
    # Compiled, a flat dict of tensors flattens to a tree.DictSpec; eagerly to an optree spec.
    flat = tree.flatten({"w": x, "b": x})[1]
    reordered = tree.flatten({"b": x * 2, "w": x})[1]
    fewer = tree.flatten({"w": x})[1]
    nested = tree.flatten({"w": x, "b": (x,)})[1]
    of_floats = tree.flatten({"w": x, "b": 0.0})[1]  # a float leaf: an optree spec, also compiled
    return (
        tree.same_structure(flat, reordered),
        tree.same_structure(flat, fewer),
        tree.same_structure(flat, nested),
        tree.same_structure(nested, flat),
        tree.same_structure(flat, of_floats),
        tree.same_structure(of_floats, flat),
    )


@pytest.mark.compile
def test_same_structure_compares_the_flat_dict_specs_of_compiled_steps():
    eager = _flat_dict_comparisons(torch.ones(2))
    assert eager == (True, False, False, False, True, True)
    assert torch.compile(_flat_dict_comparisons, fullgraph=True, backend="eager")(torch.ones(2)) == eager


def _dict_spec_taken(x: torch.Tensor) -> tuple[bool, ...]:
    # (A dict with other than string keys is left out: torch 2.13's dynamo cannot trace optree's
    # flatten of one at all, "SourcelessBuilder ... DictMetaData"; nor of an empty dict, so that one
    # must take the fast path.)
    trees = ({"w": x, "b": x * 2}, {"w": x, "b": 0.0}, {"w": x, "b": (x,)}, {})
    return tuple(isinstance(tree.flatten(t)[1], tree.DictSpec) for t in trees)


def test_only_flat_dicts_of_tensors_with_string_keys_take_the_fast_path_while_compiling():
    # Equal results cannot show a lost fast path (optree gives the same leaves): check which path ran.
    assert _dict_spec_taken(torch.ones(2)) == (False,) * 4
    compiled = torch.compile(_dict_spec_taken, fullgraph=True, backend="eager")(torch.ones(2))
    assert compiled == (True, False, False, True)
