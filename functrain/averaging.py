"""Weight averaging, at its old address: :mod:`functrain.optim.averaging` (``ema``, ``swa``, ``update_bn``,
reading the average) and :class:`functrain.callbacks.AveragedEvaluation`.

Example:
    >>> import functrain as ft
    >>> tx = ft.optim.chain(ft.optim.sgd(0.1), ft.averaging.ema(0.999))
"""

from functrain.callbacks.averaged import AveragedEvaluation
from functrain.optim.averaging import (
    EmaState,
    SwaState,
    averaged_params,
    ema,
    find_average,
    swa,
    update_bn,
    with_averaged_params,
)

__all__ = [
    "AveragedEvaluation",
    "EmaState",
    "SwaState",
    "averaged_params",
    "ema",
    "find_average",
    "swa",
    "update_bn",
    "with_averaged_params",
]
