"""The ``functrain`` command: :mod:`~functrain.cli.main` (subcommands and their dispatch),
:mod:`~functrain.cli.checks` (the refusals made before torch or the user's code is imported) and
:mod:`~functrain.cli.errors` (one line per error, exit codes).

Example:
    >>> from functrain.cli import main
    >>> main(["train", "run.yaml", "epochs=2"])  # doctest: +SKIP
"""

from functrain.cli.main import main, run

__all__ = ["main", "run"]
