"""Activation recompute: ft.remat and torch.utils.checkpoint inside functrain's steps (functrain.remat)."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import functrain as ft
from functrain.remat import RematRandomnessError, routed_checkpoint


class Block(nn.Module):
    def __init__(self, d: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class Net(nn.Module):
    """``how``: plain, remat (ft.remat on each block), reentrant / nonreentrant (torch.utils.checkpoint)."""

    def __init__(self, how: str = "plain", dropout: float = 0.0) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList(Block(dropout=dropout) for _ in range(3))
        self.head = nn.Linear(8, 3)
        if how == "remat":
            for block in self.blocks:
                ft.remat(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.how in ("reentrant", "nonreentrant"):
                x = torch.utils.checkpoint.checkpoint(block, x, 0.5, use_reentrant=self.how == "reentrant")
            else:
                x = block(x, 0.5)
        return self.head(x)


class HFStyleLayer(Block):
    """transformers' GradientCheckpointingLayer: calls ``self._gradient_checkpointing_func`` when on."""

    gradient_checkpointing = False

    def forward(
        self, x: torch.Tensor, scale: float = 1.0, context: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = super().forward(x, scale)
        return out if context is None else out * context

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


class HFStyleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HFStyleLayer() for _ in range(3))
        self.context = nn.Linear(8, 8)  # its gradient flows only through the layers' keyword arguments
        self.head = nn.Linear(8, 3)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        # What transformers' PreTrainedModel.gradient_checkpointing_enable does.
        func = functools.partial(torch.utils.checkpoint.checkpoint, **(gradient_checkpointing_kwargs or {}))
        for layer in self.layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = func

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = torch.sigmoid(self.context(x))
        for layer in self.layers:
            x = layer(x, scale=0.5, context=context)
        return self.head(x)


def _one_step(model: nn.Module, compile: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """New params after one SGD(lr=1) step: ``params - grads``, so equal params mean equal gradients."""
    state = ft.TrainState.create(model, ft.optim.sgd(1.0), seed=seed)
    step = ft.jit(ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy)), compile=compile)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g))
    new, _ = step(state, batch)
    if compile:  # a second call must not recompile (the routing reuses the same objects)
        step(state, batch)
        assert step.num_compiles == 1
    return new.params


def _model(cls: type[nn.Module], *args: object) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args).double()


@pytest.mark.parametrize("how", ["remat", "reentrant", "nonreentrant"])
def test_recomputed_gradients_equal_plain_ones_eager(how: str) -> None:
    reference = _one_step(_model(Net, "plain"))
    params = _one_step(_model(Net, how))
    assert params.keys() == reference.keys()
    for name in reference:
        assert torch.equal(params[name], reference[name]), name


def test_torch_checkpoint_fails_under_torch_func_without_routing() -> None:
    # The failure the routing fixes (so this test fails if torch ever supports it natively: then the
    # routing can go).
    model = _model(Net, "nonreentrant")
    params = dict(model.named_parameters())

    def loss(p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).sum()

    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(loss)(params, torch.randn(2, 8, dtype=torch.float64))


def test_hf_gradient_checkpointing_is_routed_and_restored() -> None:
    reference = _one_step(_model(HFStyleModel))
    model = _model(HFStyleModel)
    model.gradient_checkpointing_enable({"use_reentrant": True})
    original = model.layers[0]._gradient_checkpointing_func
    params = _one_step(model)
    for name in reference:
        assert torch.equal(params[name], reference[name]), name
    assert model.layers[0]._gradient_checkpointing_func is original
    assert torch.utils.checkpoint.checkpoint is original.func


def test_remat_replays_dropout_masks_eagerly() -> None:
    # Same seed, same dropout masks: remat's recomputation must draw the forward's masks again.
    reference = _one_step(_model(Net, "plain", 0.5), seed=3)
    params = _one_step(_model(Net, "remat", 0.5), seed=3)
    for name in reference:
        assert torch.equal(params[name], reference[name]), name


def test_remat_module_keeps_names_and_runs_outside_steps() -> None:
    block = _model(Block)
    names = [n for n, _ in block.named_parameters()]
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    expected = block(x).sum()
    (g_ref,) = torch.autograd.grad(expected, x)
    assert ft.remat(block) is block and ft.remat(block).forward is block.forward  # idempotent
    assert [n for n, _ in block.named_parameters()] == names
    out = block(x).sum()
    (g,) = torch.autograd.grad(out, x)
    assert torch.equal(out, expected) and torch.equal(g, g_ref)


def test_routing_is_undone_on_error() -> None:
    original = torch.utils.checkpoint.checkpoint
    with pytest.raises(ZeroDivisionError), routed_checkpoint(_model(HFStyleModel)):
        assert torch.utils.checkpoint.checkpoint is not original
        _ = 1 / 0
    assert torch.utils.checkpoint.checkpoint is original


def _hf_model_with_checkpointing() -> nn.Module:
    model = _model(HFStyleModel)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    return model


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_recompute_matches_eager_plain() -> None:
    plain = _one_step(_model(Net, "plain"))
    hf_plain = _one_step(_model(HFStyleModel))
    for model, reference in [
        (_model(Net, "remat"), plain),
        (_model(Net, "reentrant"), plain),
        (_hf_model_with_checkpointing(), hf_plain),
    ]:
        params = _one_step(model, compile=True)
        # float64 throughout (lr=1.0 is exact): another summation order moves these by ~1e-16, on any CPU
        for name in reference:
            torch.testing.assert_close(params[name], reference[name], rtol=1e-12, atol=1e-12)


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_remat_refuses_dropout_in_block() -> None:
    with pytest.raises(RematRandomnessError, match="outside the rematerialised block"):
        _one_step(_model(Net, "remat", 0.5), compile=True)


def test_randomness_detector_ignores_zero_dropout_attention() -> None:
    # CPU flash attention is tagged as seeded for its dropout_p: with p=0 it draws nothing, and a
    # compiled remat block with attention must not be refused for it.
    from functrain.remat import _RandomOps

    q = torch.randn(1, 2, 4, 8)
    quiet = _RandomOps()
    with quiet:
        nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0, is_causal=True)
        nn.functional.dropout(q, 0.5, training=False)
    assert quiet.seen is None
    drawing = _RandomOps()
    with drawing:
        nn.functional.dropout(q, 0.5, training=True)
    assert drawing.seen is not None


def test_unroutable_checkpoint_reference_is_refused_naming_remat() -> None:
    captured = torch.utils.checkpoint.checkpoint  # what `from torch.utils.checkpoint import checkpoint` holds

    class Captured(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = captured(block, x, use_reentrant=False)
            return self.head(x)

    with pytest.raises(RuntimeError, match=r"ft\.remat\(block\)"):
        _one_step(_model(Captured))


class _OldStyleDouble(torch.autograd.Function):
    """forward(ctx, x) and no setup_context: what torch.func refuses (DTensor's TP hooks are such)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * 2


def test_an_autograd_function_without_setup_context_is_named_not_taken_for_a_checkpoint() -> None:
    class Doubling(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _OldStyleDouble.apply(super().forward(x))

    with pytest.raises(RuntimeError) as info:
        _one_step(_model(Doubling))
    message = str(info.value)
    assert f"{__name__}._OldStyleDouble" in message and "without setup_context" in message, message
    assert "setup_context(ctx, inputs, output)" in message and "ft.jit(step)" in message, message
    assert "checkpoint" not in message, message
    # a reentrant torch.utils.checkpoint (also a Function without setup_context) keeps its own message
    captured = torch.utils.checkpoint.checkpoint

    class Reentrant(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(captured(self.blocks[0], x, use_reentrant=True))

    with pytest.raises(RuntimeError, match=r"ft\.remat\(block\)"):
        _one_step(_model(Reentrant))


def test_tensor_captured_in_closure_is_refused() -> None:
    w = torch.randn(8, 8)
    with pytest.raises(TypeError, match="closure holds the tensor 'w'"):
        ft.remat(lambda x: x @ w)


def test_function_closing_over_classes_and_modules() -> None:
    # A closure may hold classes and other callables (dynamo's checkpoint operator closes over
    # torch.fx.Interpreter): only modules are collected, and their parameters get their gradients.
    interpreter = torch.fx.Interpreter
    outer = nn.ModuleDict({"block": _model(Block)})
    rematerialised = ft.remat(lambda x: outer["block"](x) if interpreter else x)
    x = torch.randn(2, 8, dtype=torch.float64)
    params = {k: v.detach() for k, v in outer.named_parameters()}

    def loss(p: dict, fn: object) -> torch.Tensor:
        with torch.nn.utils.stateless._reparametrize_module(outer, p):
            return fn(x).sum()  # type: ignore[operator]

    expected = torch.func.grad(loss)(params, outer["block"])
    got = torch.func.grad(loss)(params, rematerialised)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


_GLOBAL_LAYER = nn.Linear(8, 8).double()


def _global_tanh(x: torch.Tensor) -> torch.Tensor:
    return _GLOBAL_LAYER(x).tanh()


def test_modules_read_through_globals_and_containers_are_found() -> None:
    # remat found only modules in a function's closure cells: a module-level layer read by a helper
    # function got a zero gradient without a word (a silently wrong gradient)
    torch.manual_seed(0)
    x = torch.randn(2, 8, dtype=torch.float64)
    params = {k: v.detach() for k, v in _GLOBAL_LAYER.named_parameters()}

    def loss(p: dict, fn: object) -> torch.Tensor:
        with torch.nn.utils.stateless._reparametrize_module(_GLOBAL_LAYER, p):
            return fn(x).sum()  # type: ignore[operator]

    expected = torch.func.grad(loss)(params, _global_tanh)

    class Holder:  # an object of one's own holding the layer as an attribute
        layer = None

    holder = Holder()
    holder.layer = _GLOBAL_LAYER
    for fn in (_global_tanh, lambda x: _global_tanh(x), lambda x: holder.layer(x).tanh()):
        got = torch.func.grad(loss)(params, ft.remat(fn))
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def test_modules_reached_another_way_are_named_in_modules() -> None:
    # A module read through a list in a closure is found (it was not: its params got no gradient);
    # named in modules=, or as their parent, their gradients are those without remat too.
    torch.manual_seed(0)
    outer = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}).double()
    layers = [outer["a"], outer["b"]]

    def stack(x: torch.Tensor) -> torch.Tensor:
        return layers[1](layers[0](x).tanh())

    x = torch.randn(2, 8, dtype=torch.float64)
    params = {k: v.detach() for k, v in outer.named_parameters()}

    def loss(p: dict, fn: object) -> torch.Tensor:
        with torch.nn.utils.stateless._reparametrize_module(outer, p):
            return fn(x).sum()  # type: ignore[operator]

    expected = torch.func.grad(loss)(params, stack)
    for rematerialised in (
        ft.remat(stack),
        ft.remat(stack, modules=layers),
        ft.remat(stack, modules=[outer]),
    ):
        got = torch.func.grad(loss)(params, rematerialised)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    with pytest.raises(TypeError, match=r"modules\[1\] is a list, not an nn.Module"):
        ft.remat(stack, modules=[outer, layers])


class _TwoPaths(nn.Module):
    """A rematerialised function that reads one block by two paths (the block, and its parent)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleDict({"block": Block()})
        block, parent = self.inner["block"], self.inner
        self.run = ft.remat(lambda x: block(x) + parent["block"].norm(x))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.run(x))


def test_a_block_read_by_two_paths_leaves_the_model_its_own_params() -> None:
    # One functional_call swapping a tensor by two names restored it in the wrong order: the model kept
    # a state's tensor, and the next TrainState.create(model) started from it.
    model = _model(_TwoPaths)
    own = {k: (p, p.detach().clone()) for k, p in model.named_parameters()}
    state = ft.TrainState.create(model, ft.optim.sgd(1.0))
    step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy))
    batch = (torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 3, (6,)))
    new, _ = step(step(state, batch)[0], batch)
    assert not torch.equal(new.params["inner.block.norm.weight"], own["inner.block.norm.weight"][1])
    for name, p in model.named_parameters():
        assert p is own[name][0] and torch.equal(p, own[name][1]), name


def test_recomputation_runs_in_the_forwards_autocast_precision() -> None:
    # The backward runs outside the step's torch.autocast: a recomputation in float32 of a bf16 forward
    # gave other gradients than the same step without remat.
    torch.manual_seed(0)
    plain, remat = Net("plain"), Net("remat")
    remat.load_state_dict(plain.state_dict())
    batch = (torch.randn(6, 8), torch.randint(0, 3, (6,)))
    grads = []
    for model in (plain, remat):
        state = ft.TrainState.create(model, ft.optim.sgd(1.0))
        step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy), precision="bf16")
        new, _ = step(state, batch)
        grads.append({k: state.params[k] - new.params[k] for k in new.params})
    for name in grads[0]:
        assert torch.equal(grads[1][name], grads[0][name]), name


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``check`` (the first op of a block: its backward runs last)."""

    @staticmethod
    def forward(x: torch.Tensor, check: object) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
        ctx.check = inputs[1]  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.check()  # type: ignore[attr-defined]
        return grad, None


class _Saving(nn.Module):
    """exp's output is saved by exp's backward and by the Linear after it; weak references to every
    one made (the forward's and the recomputation's)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)
        self.made: list = []
        self.alive_at_end: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Probe.apply(x, lambda: self.alive_at_end.append(self.made[-1]() is not None))
        y = torch.exp(self.up(x))
        self.made.append(weakref.ref(y))
        return self.down(y)


def test_recomputed_tensors_are_freed_as_the_blocks_backward_runs() -> None:
    # The recomputation ran under torch.func.vjp whose vjp_fn keeps its graph by default: every tensor
    # the block saved (a ZeRO-3 block's gathered weights) lived until the block's whole backward ended,
    # the gradient's reduce-scatter included (+4 MB per block at the sharded step's peak).
    model = nn.Sequential(_Saving(), nn.Linear(8, 3)).double()
    ft.remat(model[0])
    state = ft.TrainState.create(model, ft.optim.sgd(1.0))
    step = ft.make_train_step(model, ft.supervised_loss(nn.functional.cross_entropy))
    step(state, (torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 3, (6,))))
    assert len(model[0].made) == 2  # the forward and the recomputation
    assert model[0].alive_at_end == [False]
