"""functrain: functional, JAX-style training for PyTorch.

An immutable train state advanced by a pure step that ``torch.compile`` turns into one graph
(forward, backward and optimizer update together).
"""

from functrain import random, tree

__version__ = "0.1.0"

__all__ = ["__version__", "random", "tree"]
