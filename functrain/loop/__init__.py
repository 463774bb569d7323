"""The loop: ``fit``, ``evaluate`` and ``predict`` — thin host code around pure, compiled steps.

``fit`` folds ``train_step`` over the batches, fires callbacks between steps, evaluates, logs and saves
checkpoints when due, and resumes exactly: the data position, the callbacks' states and the history are
saved with the train state, so a run stopped at any step and restarted from its checkpoint ends
bit-identical to an uninterrupted one. The host reads device values only on logging steps (one sync for
all scalars) and at evaluations.

The package, one concept a module:

- :mod:`~functrain.loop.fit`: ``fit``, the loop itself (a dozen lines around the step);
- :mod:`~functrain.loop.options`: :class:`FitOptions`, what ``fit`` was asked, checked once;
- :mod:`~functrain.loop.run`: :class:`Run`, the host side of one ``fit`` call, made ready by ``Run.start``
  (checks, resume, ``train_begin``): the context, where the run stands, the periodic log/eval/save;
- :mod:`~functrain.loop.length`: :class:`RunLength`, the four ways to say how long;
- :mod:`~functrain.loop.schedule`: :class:`Every`, when periodic work is due;
- :mod:`~functrain.loop.evaluate`: ``evaluate`` and ``predict``;
- :mod:`~functrain.loop.state`: what a checkpoint keeps of the loop (:class:`LoopState`) and ``FitResult``;
- :mod:`~functrain.loop.window`, :mod:`~functrain.loop.events`, :mod:`~functrain.loop.data`: the logging
  window, callback events, loaders.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 2)
    >>> data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(64)]
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
    >>> result = ft.fit(state, ft.jit(ft.make_train_step(model, loss_fn), compile=False), data,
    ...                 batch_size=16, epochs=2, progress_bar=False)
    >>> int(result.state.step)
    8
"""

from functrain.loop.data import data_key
from functrain.loop.evaluate import evaluate, predict
from functrain.loop.fit import fit
from functrain.loop.length import RunLength
from functrain.loop.options import FitOptions
from functrain.loop.run import Run
from functrain.loop.schedule import Every
from functrain.loop.state import FitResult, LoopState, RunFinishedWarning

__all__ = [
    "Every",
    "FitOptions",
    "FitResult",
    "LoopState",
    "Run",
    "RunFinishedWarning",
    "RunLength",
    "data_key",
    "evaluate",
    "fit",
    "predict",
]
