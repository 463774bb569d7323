"""The built-in demo, at its old address: :mod:`functrain.trainer.demo` (``functrain demo``).

Example:
    >>> from functrain import demo
    >>> result = demo.run(output_dir="runs/demo", epochs=2)  # doctest: +SKIP
"""

from functrain.trainer.demo import DigitsCNN, config, digits_splits, run

__all__ = ["DigitsCNN", "config", "digits_splits", "run"]
