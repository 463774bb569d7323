"""What functrain changes in a user's model while ``jit`` runs a step, so the step traces as one graph.

- ``torch.utils.checkpoint`` is routed to :mod:`functrain.remat` (torch's needs saved-tensor hooks or
  an ``autograd.Function`` without ``setup_context``, neither of which ``torch.func.grad`` runs);
- ``nn.RNN``/``nn.GRU``/``nn.LSTM`` run as tensor loops when compiled (:mod:`functrain.compile.rnn`; dynamo
  refuses torch's);
- ``logging.Logger`` calls are skipped by dynamo instead of breaking the graph
  (:mod:`functrain.compile.quiet_logging`);
- ``nn.Transformer``'s causal-mask detection and ``nn.MultiheadAttention``'s inference fast path, which
  read tensor values to pick a kernel, take torch's reference path (:mod:`functrain.compile.attention_paths`);
- a tensor-parallel model's forward takes plain tensors as replicated DTensors
  (:func:`functrain.distributed.tp_forward.tensor_parallel_forward`; dynamo cannot trace the switch).

Everything is restored when the call returns.

Example:
    >>> import torch, torch.utils.checkpoint
    >>> from functrain.remat import checkpoint
    >>> model = torch.nn.Sequential(torch.nn.GRU(4, 8), torch.nn.Linear(8, 2))
    >>> with traceable(model):  # a compiled step's call: checkpoint routed, the GRU runs rnn_forward
    ...     torch.utils.checkpoint.checkpoint is checkpoint, "forward" in vars(model[0])
    (True, True)
    >>> with traceable(model, compiled=False):  # an eager step's: the GRU keeps torch's kernel
    ...     torch.utils.checkpoint.checkpoint is checkpoint, "forward" in vars(model[0])
    (True, False)
    >>> torch.utils.checkpoint.checkpoint is checkpoint  # restored on exit
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from functrain.compile.attention_paths import traceable_attention
from functrain.compile.quiet_logging import ignored_logging
from functrain.compile.rnn import functional_rnns
from functrain.distributed.tp_forward import tensor_parallel_forward
from functrain.remat import routed_checkpoint

__all__ = ["traceable"]


@contextlib.contextmanager
def traceable(model: Any, *, compiled: bool = True) -> Iterator[None]:
    """Apply the changes above to ``model`` (an ``nn.Module``; anything else: logging only).

    With ``compiled=False`` (an eager step) only the checkpoint routing applies: recurrent modules keep
    torch's kernel, which ``torch.func.grad`` runs (and cuDNN's is much faster than a loop), and log
    calls need no help outside dynamo.
    """
    if not compiled:  # no dynamo: only torch.utils.checkpoint needs routing (torch.func.grad)
        with routed_checkpoint(model), tensor_parallel_forward(model):
            yield
        return
    with (
        routed_checkpoint(model),
        functional_rnns(model),
        traceable_attention(model),
        ignored_logging(),
        tensor_parallel_forward(model),
    ):
        yield
