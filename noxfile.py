"""nox sessions: tests, lint, bench, demo.  Run ``nox`` (``pip install nox`` first): lint and the whole
test suite.

Every session installs a pinned torch before functrain: an unpinned torch pulls several GB of CUDA
packages. ``tests`` runs once per supported torch. ``nox -s "tests(torch='2.13.0')"`` (``FULL``, the
default) runs the whole suite (on a CPU build where pip finds one, as on the CI machine); every other version, ``nox -s "tests(torch='2.15.0')"``
(``NEWEST``, what ``pip install torch`` gives today), ``2.14.1`` or the floor ``2.10.0``, runs the tests
that compile a step (``FLOOR_TESTS``) on PyPI's CUDA build (about 3 GB more, it runs on a CPU too).
A machine whose pip is capped below a version (a constraint file) cannot install it: lift the cap for
that run, e.g. ``PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null nox -s "tests(torch='2.15.0')"``.
"""

from __future__ import annotations

from pathlib import Path

import nox

# The newest supported torch (the newest release when the range was last checked).
NEWEST = "2.15.0"
# The torch the whole suite runs on, as .ci/run does (keep equal to its FULL): a CPU build is at hand.
FULL = "2.13.0"
# Every supported torch, newest first; the last is pyproject.toml's torch>= floor (tested by .ci/run).
TORCH_VERSIONS = [NEWEST, "2.14.1", "2.13.0", "2.12.0", "2.11.0", "2.10.0"]
# What the other versions run: the tests that compile a step, and the docstring examples, which name
# torch's own APIs (keep in step with .ci/run's FLOOR_TESTS).
FLOOR_TESTS = [
    "tests/test_step.py",
    "tests/test_step_grad.py",
    "tests/test_jit.py",
    "tests/test_cache_hits.py",
    "tests/test_isa_probe.py",
    "tests/test_optim*.py",
    "tests/test_metrics*.py",
    "tests/test_torch_versions.py",
    "tests/test_doctests.py",
]
TORCH = f"torch=={FULL}"
nox.options.sessions = ["lint", f"tests(torch='{FULL}')"]


def _install(session: nox.Session, extras: str = "dev", torch: str = TORCH) -> None:
    session.install(torch)
    session.install("-e", f".[{extras}]")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    """The whole suite on FULL, the step/optimizer/jit/metrics tests (FLOOR_TESTS) on every other torch
    (compile-heavy tests included; add -- -m 'not compile' to skip them)."""
    _install(session, torch=f"torch=={torch}")
    if torch == FULL:
        session.run("python", "-m", "pytest", "-q", *session.posargs)
    else:
        files = sorted(str(p) for pattern in FLOOR_TESTS for p in Path().glob(pattern))
        session.run("python", "-m", "pytest", "-q", *files, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format --check."""
    session.install("ruff")
    session.run("ruff", "check", "functrain", "tests", "benchmarks", "examples")
    session.run("ruff", "format", "--check", "functrain", "tests", "benchmarks", "examples")


@nox.session
def bench(session: nox.Session) -> None:
    """The CPU benchmarks (steps, loop, checkpoint, distributed, compile, ensemble, remat, rnn); tables go to
    benchmarks/README.md. benchmarks/gpu.py needs a GPU: run it on its own there."""
    _install(session, "dev,bench")  # bench: nox and lightning (benchmarks/loop.py compares against it)
    scripts = ("steps", "loop", "checkpoint", "distributed", "compile", "ensemble", "remat", "rnn")
    for script in scripts:
        session.run("python", f"benchmarks/{script}.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The built-in demo: a small CNN on scikit-learn's digits."""
    _install(session, "demo")
    session.run("functrain", "demo", *session.posargs)
