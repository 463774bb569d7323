"""Direct calls of a compiled step's graph (functrain.compile.cache_hits) and the library-guard filter of `jit`:
the direct path is taken, and everything dynamo would recompile for still recompiles."""

from __future__ import annotations

import gc
import types

import pytest
import torch
import torch.nn.functional as F
from models import SmallCNN, classification_batch, mlp

import functrain as ft
from functrain import tree
from functrain.compile.guards import skip_library_guards as _skip_library_guards

SCALE = 2.0  # a user global read by a step: changing it must recompile


def _scaled(state, x):
    return state, x * SCALE


def _entry(name: str, is_global: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=name, is_global=is_global)


def test_library_guard_filter_keeps_user_and_nn_module_globals():
    dropped = [
        "G['__import_functrain_dot_tree'].leaves.__code__",
        "G['__import_functrain_dot_tree'].dataclasses.replace.__code__",
        "G['__builtins_dict___0']['isinstance']",
        "G['__import_torch_dot__functorch_dot_eager_transforms'].grad_and_value_impl",
        "G['__import_torch_dot_utils_dot__pytree'].SUPPORTED_NODES",
        "G['__import_torch_dot_nn_dot_utils_dot_stateless']._reparametrize_module",
        "G['torch_pytree'].tree_flatten",  # a global of functrain.compile.wrappers, where dynamo starts
        "G['_replaces'].__code__",
    ]
    kept = [
        "G['__import___main__'].SCALE",
        "G['__import_mytask'].config",
        "G['__import_functrainx'].value",  # a user package whose name starts like ours
        "G['__import_torch_dot_nn_dot_modules_dot_module']._global_forward_hooks",  # global module hooks
        "G['__import_torch_dot_utils_dot_checkpoint'].checkpoint",
        # Public torch reached through a library module's global: a user may patch it.
        "G['__import_functrain_dot_step'].nn.functional.gelu",
        "G['__import_functrain_dot_step'].torch.nn.functional.gelu",
        "G['torch'].nn.functional.gelu",
        "G['__import_functrain_dot_tree'].no_such_attribute",  # unresolvable: kept
    ]
    entries = [_entry(n) for n in dropped + kept] + [_entry("L['state'].params['w']", is_global=False)]
    keep = _skip_library_guards(entries)
    assert keep == [False] * len(dropped) + [True] * (len(kept) + 1), [
        e.name for e, k in zip(entries, keep) if k != (e.name in kept or not e.is_global)
    ]


@pytest.mark.compile
def test_patching_a_torch_function_the_model_calls_recompiles(monkeypatch):
    class Gelu(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.nn.functional.gelu(self.linear(x))

    model = Gelu()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    loss = ft.supervised_loss(F.mse_loss)
    step = ft.jit(ft.make_eval_step(model, loss))
    batch = (torch.randn(8, 4), torch.randn(8, 4))
    step(state, batch)
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda x, approximate="none": torch.zeros_like(x))
    patched = step(state, batch)["loss"]
    assert step.num_compiles == 2
    eager = ft.make_eval_step(model, loss)(state, batch)["loss"]  # with the patched gelu
    assert torch.allclose(patched, eager, rtol=1e-5), (patched, eager)
    assert torch.allclose(patched, F.mse_loss(torch.zeros(8, 4), batch[1]))


@pytest.mark.compile
def test_no_direct_calls_without_fullgraph_and_invalidated_entries_are_skipped():
    def broken(state, x):
        y = x.sin()
        torch._dynamo.graph_break()
        return state, y.cos()

    step = ft.jit(broken, seed=False, fullgraph=False)
    for _ in range(3):
        assert torch.allclose(step(None, torch.ones(3))[1], torch.ones(3).sin().cos())
    assert step._cache_hits.calls == 0, "resume functions after a graph break need dynamo's frame evaluation"

    def make_box():
        class Box:
            def __init__(self, t):
                self.t = t

        return Box

    def double(state, box):
        return state, box.t * 2

    step = ft.jit(double, seed=False)
    box = make_box()(torch.ones(3))
    step(None, box)
    step(None, box)
    del box  # dynamo invalidates the entry whose guards watched the freed class
    gc.collect()
    box = make_box()(torch.ones(3))
    for _ in range(3):
        assert torch.equal(step(None, box)[1], torch.full((3,), 2.0))
    assert step._cache_hits.enabled and step.num_compiles == 2 and step._cache_hits.calls == 3


@pytest.mark.compile
def test_calls_after_the_first_compile_run_the_graph_directly_with_the_same_results():
    """On every supported torch (the floor runs this file too): a torch that changes dynamo's private
    cache entries fails here instead of silently taking the slower path."""
    model = mlp(dropout=0.1)
    state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=3)
    make = lambda: ft.jit(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy)))  # noqa: E731
    direct, through_dynamo = make(), make()
    through_dynamo._cache_hits.enabled = False
    a = b = state
    # Bitwise: both run the one graph inductor generated for this machine (the same kernels), whichever
    # path calls it.
    for i in range(4):
        batch = classification_batch(seed=i)
        a, ma = direct(a, batch)
        b, mb = through_dynamo(b, batch)
        assert torch.equal(ma["loss"], mb["loss"])
    for x, y in zip(tree.leaves(a), tree.leaves(b)):
        assert torch.equal(x, y)
    assert direct.num_compiles == through_dynamo.num_compiles == 1
    assert direct._cache_hits.calls == 3 and through_dynamo._cache_hits.calls == 0


@pytest.mark.compile
def test_guard_failures_still_recompile_and_each_graph_is_then_called_directly():
    step = ft.jit(_scaled, seed=False, max_compiles=4)
    assert torch.equal(step(None, torch.ones(3))[1], torch.full((3,), 2.0))
    step(None, torch.ones(3))
    assert step._cache_hits.calls == 1
    step(None, torch.ones(4))  # new shape: dynamo recompiles and says why
    assert step.num_compiles == 2 and "size" in step.compile_reasons[0].lower()
    step(None, torch.ones(3))
    step(None, torch.ones(4))
    assert step.num_compiles == 2 and step._cache_hits.calls == 3

    global SCALE
    SCALE = 5.0  # a user global the graph read: guarded, so recompiled with the new value
    try:
        assert torch.equal(step(None, torch.ones(3))[1], torch.full((3,), 5.0))
        assert step.num_compiles == 3
    finally:
        SCALE = 2.0

    with torch.no_grad():  # global state is part of the guards
        step(None, torch.ones(3))
    assert step.num_compiles == 4


@pytest.mark.compile
def test_reset_stance_and_a_user_guard_filter():
    seen = []

    def keep_all(entries):
        seen.append(len(entries))
        return [True] * len(entries)

    step = ft.jit(_scaled, seed=False, options={"guard_filter_fn": keep_all})
    step(None, torch.ones(3))
    assert seen and seen[0] > 0, "the caller's guard filter must be called"
    torch._dynamo.reset()  # dynamo's caches are gone: the next call compiles again
    assert torch.equal(step(None, torch.ones(3))[1], torch.full((3,), 2.0))
    assert step.num_compiles == 2
    calls = step._cache_hits.calls
    with torch.compiler.set_stance("force_eager"):
        assert torch.equal(step(None, torch.ones(3))[1], torch.full((3,), 2.0))
    assert step._cache_hits.calls == calls, "a non-default stance goes through torch.compile"
    step(None, torch.ones(3))
    assert step._cache_hits.calls == calls + 1 and not step._lookup_in_traceable


@pytest.mark.compile
def test_train_and_eval_steps_alternate_on_one_graph_each_and_set_the_modes():
    """Also when the steps are wrapped (the Trainer's, a user's): each step puts the model in its mode
    inside its graph, so alternating them never fails a guard on a module's ``training`` flag."""
    model = SmallCNN()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    loss = ft.supervised_loss(F.cross_entropy)
    inner_train = ft.make_train_step(model, loss, freeze_batchnorm=True)
    inner_eval = ft.make_eval_step(model, loss)
    train = ft.jit(lambda state, batch: inner_train(state, batch))
    evaluate = ft.jit(lambda state, batch: inner_eval(state, batch))
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 4, (4,)))
    for _ in range(3):
        state, _ = train(state, batch)
        assert model.training and model.dropout.training and not model.features[1].training
        evaluate(state, batch)
        assert not any(m.training for m in model.modules())
    assert train.num_compiles == 1 and evaluate.num_compiles == 1
    assert train._cache_hits.calls == 2 and evaluate._cache_hits.calls == 2


@pytest.mark.compile
def test_a_profiled_direct_call_records_dynamos_compiled_region():
    step = ft.jit(_scaled, seed=False)
    step(None, torch.ones(3))
    with torch.profiler.profile() as prof:
        step(None, torch.ones(3))
    assert step._cache_hits.calls == 1
    assert any(e.name.startswith("Torch-Compiled Region") for e in prof.events())
