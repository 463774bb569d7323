"""Sharding in one process (a world of one): the request, the layout, errors, checkpoints; no launch.

The multi-process behaviour is tested under torchrun in ``test_sharding_torchrun.py``.
"""

from __future__ import annotations

import pytest
import torch
from models import mlp

import functrain as ft
from functrain import distributed
from functrain.checkpoint import sharded as ckpt
from functrain.distributed.sharding import ShardLayout, local_rows, pad_rows

LOSS = ft.supervised_loss(torch.nn.functional.cross_entropy)


def _tx() -> ft.optim.GradientTransformation:
    return ft.optim.chain(ft.optim.clip_by_global_norm(0.1), ft.optim.adamw(1e-2, weight_decay=0.1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def test_rows_are_padded_on_dim_0_and_cut_in_equal_blocks() -> None:
    sharding = distributed.Sharding("params", None, 1, 4)
    x = torch.arange(10.0).reshape(5, 2)
    assert pad_rows(x, 4).shape == (8, 2) and pad_rows(x, 4)[5:].abs().sum() == 0
    assert torch.equal(local_rows(x, sharding), x[2:4])
    assert sharding.local_shape((5, 2)) == (2, 2) and sharding.local_shape(()) == (1,)
    last = distributed.Sharding("params", None, 3, 4)
    assert torch.equal(local_rows(x, last), torch.zeros(2, 2))  # padding only


@pytest.mark.parametrize("level", ["optimizer", "grads", "params"])
def test_one_rank_sharded_step_equals_the_plain_step(level: str) -> None:
    torch.manual_seed(0)
    model = mlp().double()
    sharding = distributed.fully_shard(level=level)
    state = ft.TrainState.create(model, _tx(), sharding=sharding)
    plain = ft.TrainState.create(model, _tx())
    assert isinstance(state.layout, ShardLayout) and state.layout.request is sharding
    assert state.num_params == plain.num_params
    step = ft.make_train_step(model, LOSS, sharding=sharding, accumulate=2)
    plain_step = ft.make_train_step(model, LOSS, accumulate=2)
    for _ in range(3):
        state, m = step(state, _batch())
        plain, pm = plain_step(plain, _batch())
    for k, v in state.state_dict().items():
        torch.testing.assert_close(v, plain.state_dict()[k], rtol=0, atol=1e-14)
    torch.testing.assert_close(m["grad_norm"], pm["grad_norm"])


def test_full_gradients_apply_to_a_sharded_state() -> None:
    model = mlp().double()
    state = ft.TrainState.create(model, ft.optim.sgd(0.5), sharding=distributed.fully_shard())
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    new = state.apply_gradients(grads)
    assert int(new.step) == 1
    for k, v in new.params.items():
        assert torch.equal(v, state.params[k] - 0.5)


def test_bad_requests_name_what_to_do() -> None:
    model = mlp()
    with pytest.raises(ValueError, match="level must be one of"):
        distributed.fully_shard(level="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="param_dtype must be a floating dtype"):
        distributed.fully_shard(param_dtype=torch.int64)
    sharding = distributed.fully_shard()
    with pytest.raises(ValueError, match="not both"):
        ft.make_train_step(model, LOSS, sharding=sharding, gradient_reducer=distributed.gradient_reducer())
    with pytest.raises(ValueError, match="fp16"):
        ft.make_train_step(model, LOSS, sharding=sharding, precision="fp16")
    with pytest.raises(TypeError, match="fully_shard"):
        ft.make_train_step(model, LOSS, sharding="params")
    step = ft.make_train_step(model, LOSS, sharding=sharding)
    with pytest.raises(ValueError, match="not sharded"):
        step(ft.TrainState.create(model, ft.optim.sgd(0.1)), (torch.randn(2, 8), torch.tensor([0, 1])))
    other = ft.TrainState.create(
        model, ft.optim.sgd(0.1), sharding=distributed.fully_shard(level="optimizer")
    )
    with pytest.raises(ValueError, match="pass the same fully_shard"):
        step(other, (torch.randn(2, 8), torch.tensor([0, 1])))
    with torch.device("meta"):
        meta = mlp()
    with pytest.raises(ValueError, match="meta device"):
        ft.TrainState.create(meta, ft.optim.sgd(0.1), sharding=sharding)


def test_bf16_params_gather_and_fp32_master_and_reduction() -> None:
    torch.manual_seed(0)
    model = mlp()
    sharding = distributed.fully_shard(param_dtype=torch.bfloat16)
    state = ft.TrainState.create(model, ft.optim.adamw(1e-2), sharding=sharding)
    # float32 inputs meet bf16 params under autocast (precision="bf16"), or come in bf16
    step = ft.make_train_step(model, LOSS, sharding=sharding, precision="bf16")
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    new, m = step(state, (x, y))
    assert all(v.dtype == torch.float32 for v in new.params.values())
    # the reference: the same step with the params rounded to bf16 for the forward and backward

    def loss(p: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return LOSS(lambda t: torch.func.functional_call(model, p, (t,)), (x, y))[0].float()

    grads = torch.func.grad(loss)({k: v.to(torch.bfloat16) for k, v in state.params.items()})
    torch.testing.assert_close(m["grad_norm"], ft.tree.global_norm({k: g.float() for k, g in grads.items()}))


def test_checkpoint_roundtrip_and_refusals(tmp_path: str) -> None:
    model = mlp().double()
    sharding = distributed.fully_shard()
    state = ft.TrainState.create(model, _tx(), sharding=sharding)
    state, _ = ft.make_train_step(model, LOSS, sharding=sharding)(state, _batch())
    assert ckpt.latest_sharded(tmp_path) is None
    ckpt.save_sharded(tmp_path, 1, state, metrics={"loss": 0.5})
    ckpt.save_sharded(tmp_path, 1, state)  # re-saving a step replaces it
    assert ckpt.sharded_steps(tmp_path) == [1]
    back = ckpt.restore_sharded(tmp_path, target=state)
    for a, b in zip(ft.tree.leaves(back), ft.tree.leaves(state)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    wrong = ft.TrainState.create(mlp(hidden=5).double(), _tx(), sharding=sharding)
    with pytest.raises(ft.checkpoint.CheckpointError, match="does not match the target"):
        ckpt.restore_sharded(tmp_path, target=wrong)


def test_a_shard_file_in_the_wrong_slot_is_refused(tmp_path: str) -> None:
    # The DCP failure: one rank's tensor kept for every rank. Rank files name their slot; a file holding
    # another rank's shard (here: a world-1 file renamed into a world-2 checkpoint) is refused.
    import os
    import shutil

    model = mlp().double()
    state = ft.TrainState.create(model, _tx(), sharding=distributed.fully_shard())
    folder = ckpt.save_sharded(tmp_path, 1, state)
    manifest_path = os.path.join(folder, ckpt.MANIFEST)
    header = ft.checkpoint.read_header(manifest_path)
    forged = dict(header.metadata["functrain_sharded"], world_size=2)
    forged["files"] = ["rank_00000_of_00001.ckpt", "rank_00001_of_00002.ckpt"]
    shutil.copy(
        os.path.join(folder, "rank_00000_of_00001.ckpt"), os.path.join(folder, "rank_00001_of_00002.ckpt")
    )
    ft.checkpoint.save(manifest_path, {}, step=1, metadata={"functrain_sharded": forged})
    with pytest.raises(ft.checkpoint.CheckpointError, match="shards were mixed up"):
        ckpt.restore_sharded(tmp_path)


def _graph_calling(target: object, nested: bool) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.call_function(target, (graph.placeholder("x"), 2, "0")))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    if not nested:
        return module
    outer, root = torch.fx.Graph(), torch.nn.Module()
    root.block = module  # a block's gather sits in its autograd.Function's forward: a subgraph
    outer.output(outer.call_module("block", (outer.placeholder("x"),)))
    return torch.fx.GraphModule(root, outer)


@pytest.mark.parametrize("nested", [False, True])
def test_a_gathering_step_compiles_without_hoisting_its_gathers(monkeypatch, nested: bool) -> None:
    # inductor's reorder_for_locality moved every block's all-gather (it reads step inputs only) to the
    # top of the graph: all blocks' params whole at once (compiled peak 46 MB where eager had 28)
    from functrain.compile import backend

    seen: list[dict] = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(dict(config_patches or {}))
        return gm

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    for target, options in ((gather, {}), (torch.add, {}), (gather, {"reorder_for_locality": True})):
        backend.compile_graph(_graph_calling(target, nested), [torch.ones(2)], options)
    assert seen[0]["reorder_for_locality"] is False
    assert "reorder_for_locality" not in seen[1]  # no gather: inductor's default
    assert seen[2]["reorder_for_locality"] is True  # the caller's options win
