"""A module's variables as plain trees: trainable params, the other tensors, tied and non-persistent names.

Below the train state (:mod:`functrain.state`), the step and ZeRO's blocks, which all read a model this way.

Example:
    >>> import torch
    >>> params, buffers, tied, non_persistent = model_variables(torch.nn.BatchNorm1d(2), copy=False)
    >>> sorted(params), sorted(buffers)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["model_variables"]


def model_variables(
    model: nn.Module, *, copy: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Detached copies of a module's trainable parameters and of its other tensors (with
    ``copy=False``, detached views sharing the module's memory).

    Returns ``(params, buffers, tied, non_persistent)``:
    - ``params``: parameters with ``requires_grad=True``, one entry per distinct tensor (tied weights
      appear once, under their first name);
    - ``buffers``: buffers, plus parameters with ``requires_grad=False`` (they are passed to the model but
      neither differentiated nor updated: the PyTorch way of freezing works as users expect);
    - ``tied``: ``(alias, canonical)`` name pairs for tensors registered under several names;
    - ``non_persistent``: buffer names that ``state_dict()`` leaves out.
    """

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if copy else t.detach()

    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}
    tied: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied.append((name, first_name[id(p)]))
            continue
        first_name[id(p)] = name
        (params if p.requires_grad else buffers)[name] = own(p)
    non_persistent: list[str] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for b_name, b in module.named_buffers(prefix=mod_name, recurse=False, remove_duplicate=False):
            if b is None:
                continue
            if id(b) in first_name:
                if b_name != first_name[id(b)]:
                    tied.append((b_name, first_name[id(b)]))
                continue
            first_name[id(b)] = b_name
            buffers[b_name] = own(b)
            if b_name.rsplit(".", 1)[-1] in module._non_persistent_buffers_set:
                non_persistent.append(b_name)
    return params, buffers, tuple(tied), tuple(non_persistent)
