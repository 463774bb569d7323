"""``nn.RNN``/``nn.GRU``/``nn.LSTM`` as tensor loops inside compiled steps (implemented in
:mod:`functrain.compile.rnn`; this module keeps the documented name).

Example:
    >>> from functrain.rnn import rnn_forward  # the module's own weights, torch's semantics
"""

from functrain.compile.rnn import functional_rnns, rnn_forward

__all__ = ["functional_rnns", "rnn_forward"]
