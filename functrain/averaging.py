"""Weight averaging, at its old address: :mod:`functrain.optim.averaging` (``ema``, ``swa``, ``update_bn``,
reading the average) and :class:`functrain.callbacks.AveragedEvaluation`.

Example:
    >>> import functrain as ft
    >>> tx = ft.optim.chain(ft.optim.sgd(0.1), ft.averaging.ema(0.999))
"""

from functrain.callbacks.averaged import AveragedEvaluation
from functrain.optim import averaging as _optim_averaging
from functrain.optim.averaging import *  # noqa: F403 - the old address: every public name of the module

__all__ = ["AveragedEvaluation", *_optim_averaging.__all__]
