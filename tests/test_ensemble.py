"""Ensembles: stacked states (create/member/stack) and the vmapped train/eval/predict steps (eager)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import SmallCNN, classification_batch, mlp

import functrain as ft
from functrain import tree

LOSS = ft.supervised_loss(F.cross_entropy)


def _equal(a, b) -> bool:
    la, lb = tree.leaves(a), tree.leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def _max_diff(a, b) -> float:
    return max(
        (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        for x, y in zip(tree.leaves(a), tree.leaves(b))
        if isinstance(x, torch.Tensor)
    )


def _cnn_batches(k: int, n: int = 8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(k)]


# ------------------------------------------------------------------------------------ stacked states


def test_create_stacks_every_leaf_and_members_differ_by_init_rng_and_hyperparams():
    model = mlp()
    state = ft.ensemble.create(
        model,
        ft.optim.adamw(1e-3, weight_decay=0.0),
        seeds=[3, 4, 5],
        hyperparams={"learning_rate": [1e-3, 3e-3, 1e-2], "weight_decay": [0.0, 0.1, 0.2]},
    )
    assert ft.ensemble.is_ensemble(state) and ft.ensemble.size(state) == 3
    assert state.step.shape == (3,) and state.rng.shape == (3, 2)
    assert state.params["0.weight"].shape == (3, 16, 8)
    hp = ft.optim.hyperparams(state.opt_state)
    assert torch.equal(hp["learning_rate"], torch.tensor([1e-3, 3e-3, 1e-2]))
    assert torch.equal(hp["weight_decay"], torch.tensor([0.0, 0.1, 0.2]))
    w = state.params["0.weight"]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert torch.equal(state.rng[1], ft.random.key(4))
    # member i starts from initialise(model, seeds[i]), reproducibly, without touching the global RNG
    before = torch.random.get_rng_state()
    again = ft.ensemble.initialise(model, 4)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(again[0].weight, w[1])
    assert torch.equal(model[0].weight, mlp_weight := model[0].weight) and mlp_weight is model[0].weight


def test_share_init_starts_every_member_from_the_models_weights():
    model = mlp()
    state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=2, share_init=True)
    assert torch.equal(state.params["0.weight"][0], model[0].weight.detach())
    assert torch.equal(state.params["0.weight"][1], model[0].weight.detach())
    assert not torch.equal(state.rng[0], state.rng[1])


def test_member_is_an_ordinary_checkpointable_state_and_stack_inverts_it(tmp_path):
    model = mlp()
    state = ft.ensemble.create(model, ft.optim.adam(1e-3), n=3)
    one = ft.ensemble.member(state, 1)
    assert not ft.ensemble.is_ensemble(one) and one.step.shape == () and one.rng.shape == (2,)
    fresh = mlp()
    one.load_into(fresh)
    assert torch.equal(fresh[2].weight, state.params["2.weight"][1])
    # own memory: writing into the member leaves the ensemble alone
    one.params["0.weight"].zero_()
    assert state.params["0.weight"][1].abs().sum() > 0
    assert _equal(ft.ensemble.stack(ft.ensemble.members(state)), state)
    # the whole ensemble is one checkpoint, restored bit-exactly
    ft.checkpoint.save(tmp_path / "ens.ftc", {"state": state})
    raw = ft.checkpoint.restore(tmp_path / "ens.ftc")
    assert torch.equal(raw["state"]["params"]["0.weight"], state.params["0.weight"])


def test_errors_name_the_problem():
    model = mlp()
    tx = ft.optim.sgd(0.1)
    a = ft.TrainState.create(model, tx, seed=0)
    wide = ft.TrainState.create(mlp(hidden=32), tx, seed=0)
    with pytest.raises(ValueError, match=r"state\.params\['0\.bias'\].*\[16\].*\[32\]"):
        ft.ensemble.stack([a, wide])
    other = ft.TrainState.create(torch.nn.Linear(8, 3), tx)
    with pytest.raises(ValueError, match="only in member 0"):
        ft.ensemble.stack([a, other])
    with pytest.raises(ValueError, match="share one optimizer"):
        ft.ensemble.stack([a, ft.TrainState.create(model, ft.optim.sgd(0.1))])
    with pytest.raises(ValueError, match="disagree"):
        ft.ensemble.create(model, tx, n=3, seeds=[0, 1])
    with pytest.raises(KeyError, match="unknown hyperparameter 'lr'"):
        ft.ensemble.create(model, tx, hyperparams={"lr": [0.1, 0.2]})

    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

    with pytest.raises(ValueError, match=r"no reset_parameters.*share_init=True"):
        ft.ensemble.create(Raw(), tx, n=2)
    assert ft.ensemble.size(ft.ensemble.create(Raw(), tx, n=2, share_init=True)) == 2
    with pytest.raises(IndexError, match="out of range for 2"):
        ft.ensemble.member(ft.ensemble.create(model, tx, n=2), 2)


# ------------------------------------------------------------------------------------ the step


def _train_alone(model, lr, wd, seed, batches, **step_kwargs):
    state = ft.TrainState.create(
        ft.ensemble.initialise(model, seed), ft.optim.adamw(lr, weight_decay=wd), seed=seed
    )
    step = ft.jit(ft.make_train_step(model, LOSS, **step_kwargs), compile=False)
    for b in batches:
        state, _ = step(state, b)
    return state


LRS = [1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2, 3e-3, 1e-3]
WDS = [0.0, 0.01, 0.1, 0.0, 0.01, 0.1, 0.0, 0.05]


def _train_ensemble(model, batches, **step_kwargs):
    state = ft.ensemble.create(
        model,
        ft.optim.adamw(1e-3),
        seeds=list(range(8)),
        hyperparams={"learning_rate": LRS, "weight_decay": WDS},
    )
    step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS, **step_kwargs)), compile=False)
    for b in batches:
        state, metrics = step(state, b)
    return state, metrics


def test_each_of_8_members_after_50_steps_matches_the_member_trained_alone():
    """The acceptance test. Under vmap an MLP's matmuls run batched over the member axis: other BLAS
    calls than the single model's. They agree bit for bit on this machine (AVX-512, and with
    ATEN_CPU_CAPABILITY=avx2/default, MKL_ENABLE_INSTRUCTIONS=AVX2/SSE4_2), but no BLAS promises that
    across shapes, so float leaves are compared at float32 rounding and the rest exactly. A member given
    another's learning rate or weight decay is ~1e-2 off after 50 steps."""
    model = mlp()
    batches = [classification_batch(16, seed=s) for s in range(50)]
    state, metrics = _train_ensemble(model, batches)
    assert metrics["loss"].shape == (8,)
    for i in range(8):
        alone = _train_alone(model, LRS[i], WDS[i], i, batches)
        member = ft.ensemble.member(state, i)
        pairs = list(zip(tree.leaves(member), tree.leaves(alone), strict=True))
        exact = [(x, y) for x, y in pairs if not (isinstance(x, torch.Tensor) and x.is_floating_point())]
        assert _equal([x for x, _ in exact], [y for _, y in exact]), f"member {i}"  # steps, counts, keys
        assert _max_diff(member, alone) < 1e-5, f"member {i}"


def test_batchnorm_cnn_members_match_alone_within_1e5():
    """Convolutions under vmap run as one grouped convolution (another kernel, another summation
    order), so a BatchNorm CNN's members agree with the single models to ~1e-7, not bitwise."""
    model = SmallCNN(dropout=0.0)
    batches = _cnn_batches(20)
    state, _ = _train_ensemble(model, batches)
    assert state.buffers["features.1.running_mean"].shape == (8, 4)
    assert torch.equal(state.buffers["features.1.num_batches_tracked"], torch.full((8,), 20))
    for i in (0, 5):
        alone = _train_alone(model, LRS[i], WDS[i], i, batches)
        assert _max_diff(ft.ensemble.member(state, i), alone) < 1e-5
        assert not torch.equal(alone.buffers["features.1.running_mean"], torch.zeros(4))


def test_accumulation_per_member_matches_alone():
    model = mlp()
    batches = [classification_batch(16, seed=s) for s in range(10)]
    state, _ = _train_ensemble(model, batches, accumulate=2)
    for i in (1, 6):
        alone = _train_alone(model, LRS[i], WDS[i], i, batches, accumulate=2)
        assert _max_diff(ft.ensemble.member(state, i), alone) < 1e-5


def test_bf16_members_close_to_alone():
    """Under vmap, autocast applies to the batched ops linear decomposes into (a bf16 matmul, then a
    float32 bias add), not to linear as a whole: the same bf16 arithmetic up to bf16 rounding."""
    model = mlp()
    state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=3)
    batch = classification_batch(16)
    step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS, precision="bf16")), compile=False)
    new, metrics = step(state, batch)
    single = ft.jit(ft.make_train_step(model, LOSS, precision="bf16"), compile=False)
    for i in range(3):
        alone, m = single(ft.ensemble.member(state, i), batch)
        assert abs(float(metrics["loss"][i]) - float(m["loss"])) < 1e-2
        assert _max_diff(ft.ensemble.member(new, i), alone) < 2e-3
        ref32, _ = ft.jit(ft.make_train_step(model, LOSS), compile=False)(ft.ensemble.member(state, i), batch)
        assert _max_diff(ft.ensemble.member(new, i), ref32) > 0  # bf16 really ran


def test_step_is_pure_and_dropout_reproducible_per_state():
    model = mlp(dropout=0.5)
    state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=4, share_init=True)
    step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS)), compile=False)
    batch = classification_batch(16)
    before = [x.clone() for x in tree.leaves(state)]
    s1, m1 = step(state, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, tree.leaves(state))), "the input state changed"
    s2, m2 = step(state, batch)
    assert _equal(s1, s2) and torch.equal(m1["loss"], m2["loss"])
    # same initial weights, same batch: the members differ only through their own dropout masks
    assert len(set(m1["loss"].tolist())) == 4
    # the masks follow the state: another step count draws others
    _, m3 = step(state.replace(step=state.step + 1), batch)
    assert not torch.equal(m1["loss"], m3["loss"])


def test_donation_gives_the_pure_result_and_metric_states_are_per_member():
    model = mlp()
    collection = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    state = ft.ensemble.create(model, ft.optim.adam(1e-2), n=3, metrics=collection.empty())
    train_step = ft.make_train_step(model, LOSS, metrics=collection)
    pure = ft.jit(ft.ensemble.step(train_step), compile=False)
    donating = ft.jit(ft.ensemble.step(train_step), compile=False, donate=True)
    batches = [classification_batch(16, seed=s) for s in range(3)]
    a = b = state
    b = tree.map(lambda x: x.clone(), b)
    for batch in batches:
        a, _ = pure(a, batch)
        b, _ = donating(b, batch)
    assert _equal(a, b)
    with pytest.raises(ValueError, match="member count is not known yet"):
        pure.step.metrics.empty()
    per_member = pure.step.metrics.compute(a.metrics)["accuracy"]
    assert per_member.shape == (3,)
    single = ft.jit(train_step, compile=False)
    for i in range(3):
        s = ft.ensemble.member(state, i)
        for batch in batches:
            s, _ = single(s, batch)
        assert float(collection.compute(s.metrics)["accuracy"]) == float(per_member[i])
    empty = pure.step.metrics.empty()
    assert tree.leaves(empty)[0].shape[0] == 3


def test_eval_and_predict_steps_per_member_and_mean():
    model = SmallCNN(dropout=0.5)
    state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=3)
    batch = _cnn_batches(1, n=5)[0]
    collection = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    ens_eval = ft.jit(
        ft.ensemble.eval_step(ft.make_eval_step(model, LOSS, metrics=collection)), compile=False
    )
    out = ens_eval(state, batch)
    assert out["loss"].shape == (3,) and out["num_examples"] == 5
    single_eval = ft.make_eval_step(model, LOSS, metrics=collection)
    ens_predict = ft.ensemble.predict_step(ft.make_predict_step(model))
    pred = ens_predict(state, batch)
    assert pred["members"].shape == (5, 3, 4) and pred["mean"].shape == (5, 4)
    for i in range(3):
        alone = single_eval(ft.ensemble.member(state, i), batch)
        assert abs(float(out["loss"][i]) - float(alone["loss"])) < 1e-6
        logits = ft.make_predict_step(model)(ft.ensemble.member(state, i), batch)
        assert (pred["members"][:, i] - logits).abs().max() < 1e-6
    assert torch.allclose(pred["mean"], pred["members"].mean(1))
    # eval mode: no dropout, running statistics read, not updated
    assert torch.equal(ens_eval(state, batch)["loss"], out["loss"])
    # ft.predict concatenates the batches of an ensemble's predictions
    collected = ft.predict(state, ens_predict, batch[0], batch_size=2, collect=True)
    assert collected["members"].shape == (5, 3, 4)


def test_split_batch_gives_each_member_its_own_batch():
    model = mlp()
    state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=2)
    b0, b1 = classification_batch(8, seed=0), classification_batch(8, seed=1)
    stacked = (torch.stack([b0[0], b1[0]]), torch.stack([b0[1], b1[1]]))
    step = ft.jit(ft.ensemble.step(ft.make_train_step(model, LOSS), batch_axis=0), compile=False)
    new, _ = step(state, stacked)
    single = ft.jit(ft.make_train_step(model, LOSS), compile=False)
    for i, b in enumerate((b0, b1)):
        # both operands batched: a batched matmul (bmm), so equal to ~1e-7 rather than bitwise
        assert _max_diff(ft.ensemble.member(new, i), single(ft.ensemble.member(state, i), b)[0]) < 1e-6
    assert "step=[1, 1]" in repr(new)


def test_refuses_a_compiled_step_and_data_parallel_steps():
    model = mlp()
    with pytest.raises(TypeError, match="jit the ensemble step"):
        ft.ensemble.step(ft.jit(ft.make_train_step(model, LOSS)))


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_ensemble_is_one_graph_and_matches_eager():
    model = mlp()
    state = ft.ensemble.create(
        model, ft.optim.adamw(1e-2), n=4, hyperparams={"weight_decay": [0, 0.1, 0.2, 0.3]}
    )
    train_step = ft.ensemble.step(ft.make_train_step(model, LOSS))
    compiled = ft.jit(train_step)
    eager = ft.jit(train_step, compile=False)
    a = b = state
    for s in range(6):
        batch = classification_batch(16, seed=s)
        a, _ = compiled(a, batch)
        b, _ = eager(b, batch)
    assert compiled.num_compiles == 1
    assert _max_diff(a, b) < 1e-5
    # an eval step with per-member metric states: one graph too (nothing it reads changes between calls)
    collection = ft.metrics.Collection({"accuracy": ft.metrics.Accuracy()})
    ens_eval = ft.jit(ft.ensemble.eval_step(ft.make_eval_step(model, LOSS, metrics=collection)))
    data = torch.utils.data.TensorDataset(*classification_batch(32, seed=9))
    results = [ft.evaluate(a, ens_eval, data, batch_size=16) for _ in range(2)]
    assert ens_eval.num_compiles == 1 and results[0] == results[1]
    assert "eval/accuracy/member_3" in results[0]


@pytest.mark.parametrize(
    "name",
    [
        "functrain.ensemble",
        "functrain.ensemble.stacked",
        "functrain.ensemble.steps",
        "functrain.core.member_names",
        "functrain.core.foreach",
    ],
)
def test_docstring_examples(name):
    import doctest
    import importlib

    model = torch.nn.Linear(4, 3)
    globs = {"ft": ft, "torch": torch, "model": model, "loss": LOSS}
    result = doctest.testmod(
        importlib.import_module(name), extraglobs=globs, optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0 and result.failed == 0


def test_run_step_is_the_members_shared_step_count():
    model = torch.nn.Linear(4, 3)
    state = ft.ensemble.create(model, ft.optim.sgd(0.1), n=3)
    step = ft.jit(
        ft.ensemble.step(ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))), compile=False
    )
    for _ in range(2):
        state, _ = step(state, (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    assert state.step.shape == (3,) and ft.ensemble.run_step(state) == 2
    single = ft.TrainState.create(model, ft.optim.sgd(0.1))
    assert ft.ensemble.run_step(single) == 0
