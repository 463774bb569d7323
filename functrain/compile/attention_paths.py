"""torch's ``nn.Transformer`` family inside a compiled step: no data-dependent choice of a kernel.

Two checks in ``torch.nn`` pick a faster kernel by looking at tensor *values*, which a one-graph step
cannot do (dynamo refuses, under ``fullgraph=True``: ``Could not guard on data-dependent expression``):

- ``nn.Transformer``/``TransformerEncoder``/``TransformerDecoder`` call
  ``torch.nn.modules.transformer._detect_is_causal_mask``, which compares a given mask with a causal one
  (``bool((mask == causal).all())``) to pass ``is_causal=True`` down to attention;
- the inference fast path of ``TransformerEncoder`` (nested tensors built from the padding mask,
  ``torch._nested_tensor_from_mask_left_aligned``), ``TransformerEncoderLayer``
  (``torch._transformer_encoder_layer_fwd``) and ``MultiheadAttention``
  (``torch._native_multi_head_attention``), taken in eval mode without gradients.

While a compiled step runs a model holding one of these modules, :func:`traceable_attention` makes the
first return the caller's hint as given (``is_causal is True``: a mask given without a hint is applied
as that mask, which is what eager computes when the check says "not causal", and the same numbers when it
says "causal") and turns the fast path off (``torch.backends.mha``), so every layer runs torch's
reference path, the one eager training runs. Everything is restored when the call returns.

Example (eagerly here; inside a compiled step the routed paths are what dynamo traces):
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    >>> model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    >>> x, mask = torch.randn(2, 5, 8), nn.Transformer.generate_square_subsequent_mask(5)
    >>> with torch.no_grad(), traceable_attention(model):
    ...     routed = model(x, mask=mask)
    ...     torch.backends.mha.get_fastpath_enabled()  # every layer takes torch's reference path
    False
    >>> torch.backends.mha.get_fastpath_enabled()  # restored on exit
    True
    >>> with torch.no_grad():  # the same numbers as torch's own choice of kernel
    ...     torch.allclose(routed, model(x, mask=mask), atol=1e-5)
    True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch.backends.mha as mha_backend
import torch.nn.modules.transformer as transformer_module
from torch import nn

from functrain.core.patch import patched

__all__ = ["causal_hint", "traceable_attention"]

_ATTENTION = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.MultiheadAttention,
)
_FOUND: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def causal_hint(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    """``_detect_is_causal_mask`` without reading the mask: True only when the caller said so."""
    return is_causal is True


def _uses_attention(model: nn.Module) -> bool:
    # Found once per model (this runs before every step call).
    if model not in _FOUND:
        _FOUND[model] = any(isinstance(m, _ATTENTION) for m in model.modules())
    return _FOUND[model]


@contextlib.contextmanager
def traceable_attention(model: Any) -> Iterator[None]:
    """Route the value checks above while the block runs, if ``model`` holds an attention module of
    ``torch.nn``; restored on exit.

    Example:
        >>> import torch, torch.nn.modules.transformer as transformer_module
        >>> with traceable_attention(torch.nn.MultiheadAttention(8, 2)):
        ...     transformer_module._detect_is_causal_mask is causal_hint
        True
        >>> with traceable_attention(torch.nn.Linear(8, 2)):  # no attention module: nothing routed
        ...     transformer_module._detect_is_causal_mask is causal_hint
        False
    """
    routed = transformer_module._detect_is_causal_mask is causal_hint  # nested steps: already routed
    if routed or not (isinstance(model, nn.Module) and _uses_attention(model)):
        yield
        return
    with patched(
        [
            (transformer_module, "_detect_is_causal_mask", causal_hint),
            (mha_backend, "_is_fastpath_enabled", False),
        ]
    ):
        yield
