"""ZeRO-3 with blocks (``fully_shard(level="params", blocks=...)``): each block's params gathered inside
its forward and again in its recomputed backward, on 2 and 4 CPU processes (gloo) against one process on
the union batch (``sharding_blocks_worker.py``); and the block selection, in one process."""

from __future__ import annotations

import gc

import pytest
import torch
from sharding_worker import Transformer
from test_sharding_torchrun import F32, F64, _torchrun, _within
from torch import nn

import functrain as ft
from functrain import distributed
from functrain.distributed.block_spec import block_names

LOSS = ft.supervised_loss(nn.functional.cross_entropy)


def test_blocks_are_chosen_by_auto_class_name_or_predicate() -> None:
    model = Transformer()
    layers = ("encoder.layers.0", "encoder.layers.1")
    assert block_names(model, "auto") == layers
    assert block_names(model, nn.TransformerEncoderLayer) == layers
    assert block_names(model, ["encoder.layers.1"]) == ("encoder.layers.1",)
    assert block_names(model, lambda name, m: name.endswith("linear1")) == (
        "encoder.layers.0.linear1",
        "encoder.layers.1.linear1",
    )
    assert block_names(model, [nn.Linear, nn.TransformerEncoderLayer]) == (*layers, "head")  # outermost
    assert block_names(nn.Sequential(nn.Linear(2, 2)), "auto") == ()  # no repeated blocks


def test_bad_blocks_are_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="level='params'"):
        distributed.fully_shard(level="grads", blocks="auto")
    with pytest.raises(ValueError, match="'auto' or a list"):
        distributed.fully_shard(blocks="encoder")
    with pytest.raises(TypeError, match="module classes, submodule names"):
        distributed.fully_shard(blocks=[3])
    with pytest.raises(ValueError, match="not submodules"):
        block_names(Transformer(), ["encoder.layers.7"])
    bn = nn.Sequential(nn.ModuleList([nn.BatchNorm1d(2), nn.BatchNorm1d(2)]))
    with pytest.raises(ValueError, match="BatchNorm"):
        ft.make_train_step(bn, LOSS, sharding=distributed.fully_shard(blocks="auto"))
    tied = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"shared with '1\.weight'"):
        ft.make_train_step(tied, LOSS, sharding=distributed.fully_shard(blocks=["0"]))


def test_one_process_blocks_step_equals_the_plain_step() -> None:
    # a world of one runs the blocks path (remat, differentiable gather) without collectives
    torch.manual_seed(0)
    model = Transformer().double()
    sharding = distributed.fully_shard(blocks="auto")
    tx = ft.optim.chain(ft.optim.clip_by_global_norm(0.05), ft.optim.adamw(3e-2, weight_decay=0.1))
    state = ft.TrainState.create(model, tx, sharding=sharding)
    plain = ft.TrainState.create(model, tx)
    step = ft.make_train_step(model, LOSS, sharding=sharding, accumulate=2)
    plain_step = ft.make_train_step(model, LOSS, accumulate=2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)
        state, m = step(state, batch)
        plain, pm = plain_step(plain, batch)
        torch.testing.assert_close(m["loss"], pm["loss"])
    for k, v in state.state_dict().items():
        torch.testing.assert_close(v, plain.state_dict()[k], rtol=0, atol=1e-13)
    eval_step = ft.make_eval_step(model, LOSS)  # outside the train step each block runs its own forward
    assert float(eval_step(plain, batch)["loss"]) == pytest.approx(float(eval_step(state, batch)["loss"]))


def _forwards_set(model: nn.Module) -> list[str]:
    """The modules of ``model`` with a ``forward`` of their own (an instance attribute)."""
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_a_blocks_step_leaves_the_model_as_it_was(compile: bool) -> None:
    # Each block's gathering forward is set only while the step's forward and backward run: before,
    # between and after steps (and once the step is garbage) the model's modules have no forward of
    # their own, the model runs its own forward, and a forward the user set (ft.remat) is theirs again.
    torch.manual_seed(0)
    model = Transformer().double()
    user_remat = ft.remat(model.encoder.layers[1]).forward
    x = torch.randint(0, 11, (6, 5))
    before = model(x)
    sharding = distributed.fully_shard(blocks="auto")
    tx = ft.optim.sgd(0.1)
    step = ft.jit(ft.make_train_step(model, LOSS, sharding=sharding), compile=compile)
    plain_step = ft.make_train_step(model, LOSS)
    state, plain = ft.TrainState.create(model, tx, sharding=sharding), ft.TrainState.create(model, tx)

    def left_as_it_was() -> None:
        assert _forwards_set(model) == ["encoder.layers.1"]
        assert vars(model.encoder.layers[1])["forward"] is user_remat
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)

    left_as_it_was()
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(2)
    ]
    for batch in data:
        state, m = step(state, batch)
        plain, pm = plain_step(plain, batch)
        torch.testing.assert_close(m["loss"], pm["loss"])
        left_as_it_was()
    if compile:
        assert step.num_compiles == 1
    else:  # a step that fails inside the forward puts the forwards back too
        with pytest.raises(IndexError):
            step(state, (torch.full((6, 5), 99), batch[1]))
        left_as_it_was()
    del step
    gc.collect()
    left_as_it_was()


def test_bf16_blocks_compute_in_bf16_and_keep_float32_masters() -> None:
    # param_dtype=bf16 with blocks: each block's params are gathered in float32 and cast inside the
    # block's forward; the cast's backward hands float32 gradients to the reduce-scatter (FSDP2's policy:
    # compute in bf16, reduce and update in float32). Against the bf16 step without blocks: the same
    # bf16 arithmetic up to where the loss is weighted (before the backward here, after it there).
    torch.manual_seed(0)
    model = Transformer()
    own = dict(model.named_parameters())
    tx = ft.optim.sgd(0.1)  # linear in the gradients: Adam would turn rounding noise into lr-sized steps
    runs = {
        "blocks": distributed.fully_shard(blocks="auto", param_dtype=torch.bfloat16),
        "plain": distributed.fully_shard(param_dtype=torch.bfloat16),
        "float32": distributed.fully_shard(),
    }
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)
    ]
    out = {}
    for name, sharding in runs.items():
        state = ft.TrainState.create(model, tx, sharding=sharding)
        step = ft.make_train_step(
            model, LOSS, sharding=sharding, precision="bf16" if sharding.param_dtype else None
        )
        for batch in data:
            state, m = step(state, batch)
        assert all(v.dtype == torch.float32 for v in ft.tree.leaves(state.params)), name
        out[name] = (state.state_dict(), float(m["loss"]))
    # the model keeps its own parameters (a step that left a state's tensors in the blocks' slots made
    # the next TrainState.create(model) start from trained weights)
    assert all(p is own[k] for k, p in model.named_parameters())
    blocks, plain, full = out["blocks"][0], out["plain"][0], out["float32"][0]

    def gap(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())

    # bf16 arithmetic (float32 would be within 1e-6 of the float32 run), and no further from the bf16
    # step without blocks than bf16 is from float32
    assert gap(blocks, full) > 1e-4, gap(blocks, full)
    assert gap(blocks, plain) < 2 * gap(plain, full), (gap(blocks, plain), gap(plain, full))
    assert out["blocks"][1] == pytest.approx(out["plain"][1], rel=1e-2)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def parity(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp(f"blocks{request.param}"))
    return _torchrun("blocks", out_dir, request.param, script="sharding_blocks_worker.py")


@pytest.mark.slow
def test_blocks_equal_one_process_on_the_union_batch(parity: list[dict]) -> None:
    for out in parity:
        assert out["block_names"] == ("encoder.layers.0", "encoder.layers.1")
        assert out["moved"] > 1e-2 and out["cnn_moved"] > 1e-2  # the params trained: not trivially equal
        _within(out["transformer"], F64)
        _within(out["transformer/accumulate2"], F64)
        _within(out["cnn"], F64)  # BatchNorm outside the blocks, against ZeRO-3 without blocks


@pytest.mark.slow
def test_each_block_is_gathered_in_the_forward_and_again_in_the_backward(parity: list[dict]) -> None:
    for out in parity:
        assert out["gathers_per_step"] == 4 and out["cnn_gathers_per_step"] == 4  # 2 blocks x 2


@pytest.mark.slow
def test_a_blocks_gradient_reduce_scatter_is_waited_on_in_its_backward(parity: list[dict]) -> None:
    # funcol's AsyncCollectiveTensor came back wrapped inside torch.func's transforms and was never
    # waited on: c10d kept every block's reduce-scatter (and its full-size input) to the optimizer
    for out in parity:
        assert out["pending_after_block_backward"] and set(out["pending_after_block_backward"]) == {0}


@pytest.mark.slow
def test_guards_catch_zero_and_unreduced_block_gradients(parity: list[dict]) -> None:
    for out in parity:
        for name in ("zero_gradients", "unreduced_gradients"):
            assert out[f"guard/{name}"]["params"] > 1e-4, name


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_blocks_step_is_one_graph_and_matches_one_process(tmp_path: str) -> None:
    for out in _torchrun("blocks_compile", str(tmp_path), 2, script="sharding_blocks_worker.py"):
        assert out["num_compiles"] == 1
        # clipping's factor is a float32 norm that inductor may round one ulp apart from eager (as in
        # test_sharding_torchrun's compiled ZeRO-3 test): float32 tolerance on the float64 params
        _within(out["compiled"], F32)
