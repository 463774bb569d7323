"""Adam/AdamW's fused apply path (functrain.optim.fused): parity with torch.optim and with ``update``,
when it is taken and when it falls back, and what a compiled step's graph holds."""

from __future__ import annotations

import pytest
import torch
from dynamo_instructions import instructions_traced
from test_optim import _one_thread, _run_parity  # noqa: F401  (_one_thread: an autouse fixture)

from functrain import optim, tree
from functrain.optim import fused


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(fused, name)

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(len(args[0]))
        return real(*args)

    monkeypatch.setattr(fused, name, counting)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the fused kernel op (the functional one) ran, and on how many leaves (eagerly)."""
    return _count_calls(monkeypatch, "_fused_adam")


@pytest.fixture
def in_place_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The same for the in-place op a donating train step uses."""
    return _count_calls(monkeypatch, "_fused_adam_")


FUSED_PARITY = {
    "adam": (lambda: optim.adam(1e-3), lambda p: torch.optim.Adam(p, lr=1e-3, fused=True)),
    "adam_l2": (
        lambda: optim.adam(1e-3, b1=0.8, b2=0.99, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1, fused=True),
    ),
    "adamw": (
        lambda: optim.adamw(1e-3, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True),
    ),
    "amsgrad": (
        lambda: optim.adamw(1e-3, weight_decay=0.01, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, amsgrad=True, fused=True),
    ),
}


@pytest.mark.parametrize("name", list(FUSED_PARITY))
def test_fused_apply_matches_torch_optim_over_200_steps(name: str, kernel_calls: list[int]) -> None:
    make_ours, make_reference = FUSED_PARITY[name]
    assert _run_parity(make_ours, make_reference, apply=True) <= 1e-5
    assert len(kernel_calls) == 200 and kernel_calls[0] == 6  # every step, all six leaves in one call


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(4, generator=g)}


def _grads(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{k: torch.randn(v.shape, generator=g) for k, v in _params().items()} for _ in range(steps)]


def _both_paths(tx: optim.GradientTransformation, steps: int = 6):  # type: ignore[no-untyped-def]
    """(params, state) after ``steps`` steps by ``apply_gradients`` and by ``update`` + ``apply_updates``;
    the hyperparameters change by hand after the third step, as a callback would."""
    results = []
    for use_apply in (True, False):
        params = _params()
        state = tx.init(params)
        for i, grads in enumerate(_grads(steps)):
            if use_apply:
                params, state = optim.apply_gradients(tx, grads, state, params)
            else:
                updates, state = tx.update(grads, state, params)
                params = optim.apply_updates(params, updates)
            if i == 2:
                state = optim.set_hyperparams(state, learning_rate_scale=0.5, weight_decay=0.3)
        results.append((params, state))
    return results


SAME_AS_UPDATE = {
    "adamw_masked_schedule_amsgrad": lambda: optim.adamw(
        optim.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10),
        weight_decay=0.1,
        mask=lambda p: optim.mask_by_name(p, "*.weight"),
        amsgrad=True,
    ),
    "clip_then_adamw_schedule": lambda: optim.chain(
        optim.clip_by_global_norm(0.5), optim.adamw(optim.cosine_decay_schedule(0.1, 10), weight_decay=0.2)
    ),
    "adam_l2_schedule": lambda: optim.adam(optim.cosine_decay_schedule(0.1, 10), weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(SAME_AS_UPDATE))
def test_fused_apply_equals_update_then_apply_updates(name: str, kernel_calls: list[int]) -> None:
    (fused_params, fused_state), (params, state) = _both_paths(SAME_AS_UPDATE[name]())
    assert len(kernel_calls) == 6
    assert tree.structure(fused_state) == tree.structure(state)  # same state: checkpoints do not care
    moved = max(float((params[k] - _params()[k]).abs().max()) for k in params)
    assert moved > 0.05
    for ours, reference in zip(tree.leaves((fused_params, fused_state)), tree.leaves((params, state))):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    logged = {k: float(v) for k, v in optim.hyperparams(fused_state).items()}
    assert logged == pytest.approx({k: float(v) for k, v in optim.hyperparams(state).items()})
    assert logged["learning_rate_scale"] == 0.5 and logged["weight_decay"] == pytest.approx(0.3)


def test_masked_decay_leaves_unmasked_params_undecayed(kernel_calls: list[int]) -> None:
    """With a zero gradient Adam does not move a leaf: only the masked decay can."""
    tx = optim.adamw(0.1, weight_decay=0.5, mask=lambda p: optim.mask_by_name(p, "*.weight"))
    params = _params()
    new, _ = optim.apply_gradients(tx, tree.map(torch.zeros_like, params), tx.init(params), params)
    torch.testing.assert_close(new["fc.weight"], params["fc.weight"] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(new["fc.bias"], params["fc.bias"], rtol=0, atol=0)
    assert kernel_calls == [2]


def test_falls_back_where_the_kernel_does_not_apply(kernel_calls: list[int]) -> None:
    tx = optim.adamw(0.1, weight_decay=0.1)
    params, grads = _params(), _grads(1)[0]
    reference, _ = optim.apply_gradients(tx, grads, tx.init(params), params)
    trainable = {k: v.clone().requires_grad_() for k, v in params.items()}  # e.g. differentiating the step
    differentiable, _ = optim.apply_gradients(tx, grads, tx.init(params), trainable)
    assert len(kernel_calls) == 1
    assert differentiable["fc.weight"].requires_grad
    for k in params:
        torch.testing.assert_close(differentiable[k].detach(), reference[k], rtol=1e-6, atol=1e-7)


def test_vmap_runs_the_kernel_per_member_bitwise_as_alone(kernel_calls: list[int]) -> None:
    """functrain.ensemble's case: members with their own params and learning rates."""
    learning_rates = [0.1, 0.01, 0.3]
    alone = []
    for i, lr in enumerate(learning_rates):
        tx = optim.adamw(lr, weight_decay=0.1, amsgrad=True)
        params = {k: v + i for k, v in _params().items()}
        state = tx.init(params)
        for grads in _grads(3):
            params, state = optim.apply_gradients(
                tx, {k: g * (i + 1) for k, g in grads.items()}, state, params
            )
        alone.append((params, state))
    members = [tx.init({k: v + i for k, v in _params().items()}) for i in range(3)]
    tx = optim.adamw(0.1, weight_decay=0.1, amsgrad=True)  # amsgrad: no None in the state for vmap
    state = tree.map(
        lambda *xs: torch.stack(xs),
        *[optim.set_hyperparams(s, learning_rate=lr) for s, lr in zip(members, learning_rates)],
    )
    params = {k: torch.stack([v + i for i in range(3)]) for k, v in _params().items()}
    scale = torch.tensor([1.0, 2.0, 3.0])
    step = torch.func.vmap(
        lambda p, s, g, c: optim.apply_gradients(tx, {k: x * c for k, x in g.items()}, s, p),
        in_dims=(0, 0, None, 0),
    )
    for grads in _grads(3):  # vmap's batched tensors: the optimizers' foreach ops run per tensor
        params, state = step(params, state, grads, scale)
    assert len(kernel_calls) == 9 + 3 * (1 + 3)  # alone; then per vmapped step the op and its 3 members
    # bitwise: per member, torch's elementwise fused kernel runs on the same values with the same sizes
    for i, (params_i, state_i) in enumerate(alone):
        for ours, reference in zip(tree.leaves((params, state)), tree.leaves((params_i, state_i))):
            assert torch.equal(ours[i], reference), f"member {i}"


def test_apply_checks_the_gradients_structure() -> None:
    tx = optim.adamw(0.1)
    params = _params()
    with pytest.raises(ValueError, match="do not match the optimizer state"):
        optim.apply_gradients(tx, {"fc.weight": torch.ones(4, 3)}, tx.init(params), params)


def test_chain_has_apply_only_when_its_last_transform_has() -> None:
    assert optim.chain(optim.clip(1.0), optim.adamw(0.1)).apply is not None
    assert optim.chain(optim.adamw(0.1), optim.clip(1.0)).apply is None
    assert optim.sgd(0.1).apply is None
    assert optim.adamw(0.1, fused=False).apply is None and optim.adam(0.1, fused=False).apply is None


@pytest.mark.compile
def test_compiled_apply_is_one_extern_call_and_matches_eager(recording_inductor) -> None:  # type: ignore[no-untyped-def]
    graphs = recording_inductor.graphs
    torch._dynamo.reset()
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay_schedule(0.1, 10)))

    def step(params, grads, state):  # type: ignore[no-untyped-def]
        return optim.apply_gradients(tx, grads, state, params)

    compiled = torch.compile(step, fullgraph=True, backend=recording_inductor)
    eager, compiled_result = (_params(), tx.init(_params())), (_params(), tx.init(_params()))
    for grads in _grads(4):
        eager = step(*eager[:1], grads, eager[1])
        compiled_result = compiled(*compiled_result[:1], grads, compiled_result[1])
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("fused_adam" in t for t in targets) == 1
    for ours, reference in zip(tree.leaves(compiled_result), tree.leaves(eager)):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.compile
def test_compiled_ensemble_runs_the_kernel_and_matches_eager() -> None:
    """dynamo traces ensemble.step's vmap through the op's vmap rule: one graph, eager's numbers."""
    from models import classification_batch, mlp

    import functrain as ft

    model = mlp()
    loss = ft.supervised_loss(torch.nn.functional.cross_entropy)
    results = []
    for compile in (False, True):
        torch._dynamo.reset()
        state = ft.ensemble.create(model, optim.adamw(1e-2, weight_decay=0.1), n=3)
        step = ft.jit(ft.ensemble.step(ft.make_train_step(model, loss)), compile=compile)
        for seed in range(4):
            state, _ = step(state, classification_batch(16, seed=seed))
        results.append(state)
    assert step.num_compiles == 1
    for ours, reference in zip(tree.leaves(results[1].params), tree.leaves(results[0].params)):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_donating_train_step_updates_in_place_bitwise_as_pure(
    kernel_calls: list[int], in_place_calls: list[int]
) -> None:
    from models import classification_batch, mlp

    import functrain as ft

    model = mlp()
    step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    pure, donating = ft.jit(step, compile=False), ft.jit(step, compile=False, donate=True)
    expected = donated = ft.TrainState.create(model, optim.adamw(1e-2, weight_decay=0.1))
    donated = tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, donated)
    first = donated.opt_state[0].mu["0.weight"]
    for seed in range(3):
        expected, _ = pure(expected, classification_batch(16, seed=seed))
        donated, _ = donating(donated, classification_batch(16, seed=seed))
    assert (len(kernel_calls), len(in_place_calls)) == (3, 3)
    assert donated.opt_state[0].mu["0.weight"] is first  # the moments were written where they were
    # bitwise: eager both, the same fused kernel writing in place or into new tensors
    for ours, reference in zip(tree.leaves(donated), tree.leaves(expected)):
        assert torch.equal(ours, reference)


def test_donated_fp16_step_keeps_the_old_state_for_an_overflow(
    kernel_calls: list[int], in_place_calls: list[int]
) -> None:
    """An overflow step must restore the old params and moments: no in-place update under loss scaling."""
    from models import classification_batch, mlp

    import functrain as ft

    model = mlp()
    scale = ft.precision.LossScale.create(init_scale=2.0**8)
    state = ft.TrainState.create(model, optim.adamw(1e-2), loss_scale=scale)

    def overflowing(call, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.cross_entropy(call(x).float(), y) * torch.tensor(float("inf"))

    donating = ft.jit(ft.make_train_step(model, overflowing, precision="fp16"), compile=False, donate=True)
    before = tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    after, _ = donating(state, classification_batch())
    assert (len(kernel_calls), len(in_place_calls)) == (1, 0)
    assert int(after.loss_scale.skipped) == 1
    for ours, reference in zip(
        tree.leaves((after.params, after.opt_state)), tree.leaves((before.params, before.opt_state))
    ):
        assert torch.equal(ours, reference)


def test_donation_is_an_argument_given_only_to_a_step_that_declares_it(
    kernel_calls: list[int], in_place_calls: list[int]
) -> None:
    """jit(donate=True) passes ``donated=True`` to a step with that keyword (make_train_step's); a wrapper
    without it (skip_nonfinite, which needs the incoming tensors) runs the inner step undonated."""
    from models import classification_batch, mlp

    import functrain as ft

    model = mlp()
    step = ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
    state = ft.TrainState.create(model, optim.adamw(1e-2))
    ft.jit(ft.callbacks.skip_nonfinite(step), compile=False, donate=True)(state, classification_batch())
    assert (len(kernel_calls), len(in_place_calls)) == (1, 0)

    def telling(state, batch, *, donated: bool = False):  # type: ignore[no-untyped-def]
        return step(state, batch, donated=donated)

    ft.jit(telling, compile=False, donate=True)(state, classification_batch())
    assert (len(kernel_calls), len(in_place_calls)) == (1, 1)


def test_eagerly_the_kernel_runs_without_the_custom_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    # the op's dispatch (autograd wrapper, dynamo's disable) is for traces and transforms; eagerly the
    # same function runs directly, with the same result
    tx = optim.adamw(0.1, weight_decay=0.01)
    params = {"w": torch.randn(3), "b": torch.randn(2)}
    grads = {"w": torch.randn(3), "b": torch.randn(2)}
    expected, _ = optim.apply_gradients(tx, grads, tx.init(params), params)

    def refused(*args: object) -> None:
        raise AssertionError("the custom op was dispatched eagerly")

    monkeypatch.setattr(fused, "_fused_adam_op", refused)
    got, _ = optim.apply_gradients(tx, grads, tx.init(params), params)
    for name in params:
        assert torch.equal(got[name], expected[name])
    with pytest.raises(AssertionError, match="dispatched"):  # under vmap the op (its vmap rule) runs
        torch.vmap(lambda p, g: optim.apply_gradients(tx, {"w": g}, tx.init({"w": p}), {"w": p})[0]["w"])(
            torch.randn(2, 3), torch.randn(2, 3)
        )


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "where, bad",
    [
        ("param", lambda x: x.clone().requires_grad_()),
        ("param", lambda x: x.as_subclass(_Subclass)),
        ("grad", lambda x: x.to_sparse()),
        ("grad", lambda x: x.to("meta")),
        ("mu", lambda x: x.to(torch.int32)),
        ("nu", lambda x: x.as_subclass(_Subclass)),
        ("nu", lambda x: x.clone().requires_grad_()),
    ],
)
def test_eager_kernel_check_refuses_each_leaf_the_kernel_cannot_take(where: str, bad) -> None:  # type: ignore[no-untyped-def]
    """Eagerly every leaf (params, grads, moments) is checked, the last one of each list included:
    a leaf of a subclass, another layout, device or dtype, or one that needs a gradient, means the
    unfused path; so does a rate that needs a gradient."""

    def applies(rate_needs_grad: bool = False) -> bool:
        rate = torch.tensor(0.1, requires_grad=rate_needs_grad)
        return fused._kernel_applies(lists["param"], lists["grad"], [lists["mu"], lists["nu"]], [rate])

    lists = {name: [torch.ones(3), torch.ones(2, 2)] for name in ("param", "grad", "mu", "nu")}
    assert applies()
    assert not applies(rate_needs_grad=True)
    lists[where][-1] = bad(lists[where][-1])
    assert not applies()


def _apply_instructions(n_params: int) -> int:
    """Instructions dynamo interprets to trace AdamW's fused apply and the gradients' global norm over
    ``n_params`` params (what a train step's update costs its trace)."""
    params = {f"layer{i}.weight": torch.randn(3) for i in range(n_params)}
    grads = {k: torch.randn(3) for k in params}
    tx = optim.adamw(1e-3, weight_decay=0.1)

    def update(params, grads, state):  # type: ignore[no-untyped-def]
        return optim.apply_gradients(tx, grads, state, params), tree.global_norm(grads)

    return instructions_traced(update, params, grads, tx.init(params))


def test_the_traced_apply_grows_by_few_instructions_per_param() -> None:
    # Python loops and optree over the leaves (flattening params, grads and moments, the kernel's checks
    # per leaf, rebuilding the dicts, a no-op .to per norm) cost dynamo ~190 instructions a param, and a
    # 2-layer GPT step's update 12.0k of its 17.7k; builtins mapped over the leaves run in dynamo's code
    # (measured 6 a param on torch 2.13, 33 on 2.10, whose dynamo interprets more of them).
    per_param = (_apply_instructions(40) - _apply_instructions(8)) / 32
    assert per_param < 60, per_param


def test_the_traced_apply_matches_eager_bitwise() -> None:
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(4) for i in (3, 1, 2)}  # insertion order is not optree's sorted order
    grads = {k: torch.randn(4) for k in params}
    tx = optim.adamw(1e-2, weight_decay=0.1)

    def update(params, grads, state):  # type: ignore[no-untyped-def]
        return optim.apply_gradients(tx, grads, state, params), tree.global_norm(grads)

    state = tx.init(params)
    expected = update(params, grads, state)
    torch._dynamo.reset()
    traced = torch.compile(update, backend="eager", fullgraph=True)(params, grads, state)
    assert list(traced[0][0]) == list(params)
    flat_e, spec_e = torch.utils._pytree.tree_flatten(expected)
    flat_t, spec_t = torch.utils._pytree.tree_flatten(traced)
    assert spec_e == spec_t and all(a is b or torch.equal(a, b) for a, b in zip(flat_e, flat_t))
