"""nox sessions: tests, lint, bench, demo.  Run ``nox -s tests`` (``pip install nox`` first).

Every session installs the pinned CPU torch before functrain: an unpinned torch pulls several GB of
CUDA packages.
"""

from __future__ import annotations

import nox

TORCH = "torch==2.13.0"
nox.options.sessions = ["lint", "tests"]


def _install(session: nox.Session, extras: str = "dev") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (compile-heavy tests included; add -- -m 'not compile' to skip them)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format --check."""
    session.install("ruff")
    session.run("ruff", "check", "functrain", "tests", "benchmarks", "examples")
    session.run("ruff", "format", "--check", "functrain", "tests", "benchmarks", "examples")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks (steps, loop, checkpoint, distributed); tables go to benchmarks/README.md."""
    _install(session, "dev,bench")  # bench: nox and lightning (benchmarks/loop.py compares against it)
    for script in ("steps.py", "loop.py", "checkpoint.py", "distributed.py"):
        session.run("python", f"benchmarks/{script}", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The built-in demo: a small CNN on scikit-learn's digits."""
    _install(session, "demo")
    session.run("functrain", "demo", *session.posargs)
