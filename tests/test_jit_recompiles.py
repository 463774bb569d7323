"""No recompile the user did not cause: the examples' pattern (a compiled train step, `ft.evaluate` between
epochs) compiles its train step once, also when pytree node types are registered after the first call
(a lazily imported module defining a struct, a Hugging Face model module registering its outputs)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from models import classification_batch, mlp

import functrain as ft
from functrain import tree
from functrain.jit import _skip_library_guards


def _entry(name: str, is_global: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, is_global=is_global)


def test_guards_on_the_pytree_registries_are_skipped_and_user_globals_kept():
    # The names dynamo gives these guards (torch 2.13): module roots imported by name, and wrappers.
    dropped = [
        "__import__('torch').utils._pytree.SUPPORTED_NODES",
        "list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[4]",
        "__import__('torch').utils._pytree.SUPPORTED_NODES[list(dict.keys(__import__('torch').utils."
        "_pytree.SUPPORTED_NODES))[98]].flatten_fn.__closure__[0].cell_contents",
        "list(dict.keys(G['__import_optree_dot_registry']._NODETYPE_REGISTRY))[15][1]",
        "G['__import_optree_dot_registry']._NODETYPE_REGISTRY",
        "type(G['__import_functrain_dot_tree'].leaves).__call__",
    ]
    kept = [
        "__import__('torch')",  # torch itself is not library code: a user may patch its functions
        "__import__('torch').nn.functional.gelu",
        "__import__('mytask').config",
        "__import__('torch').utils",
        "list(dict.keys(G['__import___main__'].TABLE))[0]",
        "G['__import_functrain_dot_step'].torch.nn.functional.gelu",
        # one library root and one user root: the user's keeps it
        "G['__import_optree_dot_registry']._NODETYPE_REGISTRY[G['__import___main__'].KEY]",
    ]
    entries = [_entry(n) for n in dropped + kept]
    entries.append(_entry("L['state'].params[__import__('torch').utils._pytree.SUPPORTED_NODES]", False))
    keep = _skip_library_guards(entries)
    assert keep == [False] * len(dropped) + [True] * (len(kept) + 1), [
        e.name for e, k in zip(entries, keep) if k != (e.name not in dropped)
    ]


@pytest.mark.compile
def test_the_examples_pattern_compiles_the_train_step_once():
    """examples/01 and the notebook: `ft.evaluate` imported functrain.loop lazily after the first step,
    whose struct registered a pytree node, and the train step recompiled on torch's registry guard."""
    torch.manual_seed(0)
    model = mlp()
    schedule = ft.optim.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=8)
    tx = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(schedule, weight_decay=1e-4))
    state = ft.TrainState.create(model, tx, seed=0)
    loss_fn = ft.supervised_loss(F.cross_entropy)
    train_step = ft.jit(ft.make_train_step(model, loss_fn))
    eval_step = ft.jit(ft.make_eval_step(model, loss_fn, metrics=ft.metrics.Accuracy()))
    val = torch.utils.data.TensorDataset(*classification_batch(32, seed=9))
    for epoch in range(2):
        for i in range(3):
            state, metrics = train_step(state, classification_batch(seed=10 * epoch + i))
            if epoch == 0 and i == 0:
                # What a lazy import does after the first call: a functrain struct (optree and torch
                # registries) and a node registered with torch's pytree only (HF's ModelOutput).
                @tree.struct
                class LateStruct:
                    x: torch.Tensor

                class LateNode:
                    pass

                torch_pytree.register_pytree_node(
                    LateNode, lambda n: ([], None), lambda c, ctx: LateNode(), serialized_type_name="LateNode"
                )
        ft.evaluate(state, eval_step, val, batch_size=16)
    assert train_step.num_compiles == 1, train_step.compile_reasons
    assert int(state.step) == 6 and torch.isfinite(metrics["loss"])
