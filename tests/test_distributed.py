"""functrain.distributed in one process: environment parsing, no-op paths, layout checks, argument errors.

The multi-process behaviour is tested under torchrun in ``test_distributed_torchrun.py``.
"""

from __future__ import annotations

import pytest
import torch
from models import mlp

import functrain as ft
from functrain import distributed

TORCHRUN_ENV = {
    "WORLD_SIZE": "2",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}


def test_initialize_without_torchrun_is_one_cpu_process() -> None:
    with distributed.initialize(environ={}, device="cpu") as env:
        assert (env.rank, env.world_size, env.local_rank) == (0, 1, 0)
        assert env.is_main_process and not env.is_distributed
        assert env.device == torch.device("cpu") and env.backend is None
    assert distributed.world_size() == 1 and distributed.rank() == 0 and distributed.is_main_process()


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("RANK", "RANK is missing"),
        ("LOCAL_RANK", "LOCAL_RANK is missing"),
        ("MASTER_PORT", "MASTER_PORT is missing"),
    ],
)
def test_incomplete_torchrun_environment_names_the_variable(missing: str, message: str) -> None:
    environ = {k: v for k, v in TORCHRUN_ENV.items() if k != missing}
    with pytest.raises(distributed.DistributedSetupError, match=message):
        distributed.initialize(environ=environ)


def test_rank_without_world_size_and_rank_out_of_range_are_refused() -> None:
    with pytest.raises(distributed.DistributedSetupError, match="WORLD_SIZE is missing"):
        distributed.initialize(environ={"RANK": "0"})
    with pytest.raises(distributed.DistributedSetupError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        distributed.initialize(environ={**TORCHRUN_ENV, "RANK": "2"})
    with pytest.raises(distributed.DistributedSetupError, match="not an integer"):
        distributed.initialize(environ={**TORCHRUN_ENV, "WORLD_SIZE": "two"})


def test_reducer_without_process_group_leaves_the_step_unchanged() -> None:
    model = mlp()
    loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
    reducer = distributed.gradient_reducer(model=model)
    assert reducer.world_size == 1 and not reducer.active
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    batch = (torch.randn(6, 8), torch.randint(0, 3, (6,)))
    plain, m_plain = ft.make_train_step(model, loss_fn)(state, batch)
    hooked_step = ft.make_train_step(model, loss_fn, gradient_reducer=reducer)
    assert hooked_step.gradient_reducer is reducer
    hooked, m_hooked = hooked_step(state, batch)
    for k in plain.params:
        assert torch.equal(plain.params[k], hooked.params[k])
    assert torch.equal(m_plain["loss"], m_hooked["loss"])


def test_reducer_rejects_an_unknown_buffer_mode() -> None:
    with pytest.raises(ValueError, match="'mean' or 'local'"):
        distributed.gradient_reducer(buffers="sync")  # type: ignore[arg-type]


def test_hook_receives_example_count_and_its_results_are_applied() -> None:
    # A stand-in reducer (halves the gradients, records what it was given): the step must pass this
    # rank's example count and apply what the hook returns.
    seen: dict = {}

    def halve(state, grads, loss, metrics, buffers, num_examples):  # type: ignore[no-untyped-def]
        seen.update(n=num_examples, old=set(state.buffers))
        return {k: g / 2 for k, g in grads.items()}, loss * 0 + 7.0, metrics, buffers

    model = mlp()
    loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
    state = ft.TrainState.create(model, ft.optim.sgd(1.0), seed=0)
    batch = (torch.randn(5, 8), torch.randint(0, 3, (5,)))
    full, _ = ft.make_train_step(model, loss_fn)(state, batch)
    half, metrics = ft.make_train_step(model, loss_fn, gradient_reducer=halve)(state, batch)
    assert seen["n"] == 5
    assert float(metrics["loss"]) == 7.0
    for k in state.params:
        expected = state.params[k] + (full.params[k] - state.params[k]) / 2
        torch.testing.assert_close(half.params[k], expected)


def test_all_reduce_tree_checks_reductions_and_is_identity_alone() -> None:
    values = {"total": torch.tensor(3.0), "peak": torch.tensor([1, 5])}
    out = distributed.all_reduce_tree(values, {"total": "sum", "peak": "max"})
    assert torch.equal(out["total"], values["total"]) and torch.equal(out["peak"], values["peak"])
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        distributed.all_reduce_tree(values, "mean")
    with pytest.raises(ValueError, match="2 value leaves but 1 reductions"):
        distributed.all_reduce_tree(values, {"total": "sum"})


def test_merge_evaluation_alone_returns_its_inputs() -> None:
    acc = ft.metrics.Accuracy()
    state = acc.update(acc.empty(), preds=torch.tensor([[1.0, 0.0]]), target=torch.tensor([0]))
    loss_sum, count, extra, merged = distributed.merge_evaluation(
        torch.tensor(2.0), 4, {"x": 1}, state, acc, "cpu"
    )
    assert (float(loss_sum), count, extra) == (2.0, 4, {"x": 1}) and merged is state


def test_layout_allows_another_world_size_with_the_same_global_batch() -> None:
    distributed.check_resume(distributed.layout(16, 2), distributed.layout(32, 1))
    distributed.check_resume({}, distributed.layout(8, 1))  # a checkpoint from before layouts were saved
    with pytest.raises(distributed.LayoutMismatchError, match="use batch_size=8 per rank with 4 process"):
        distributed.check_resume(distributed.layout(16, 2), distributed.layout(16, 4))
    with pytest.raises(distributed.LayoutMismatchError, match="divides 32"):
        distributed.check_resume(distributed.layout(16, 2), distributed.layout(4, 3))


def test_fit_saves_the_layout_and_refuses_a_resume_with_another_global_batch(tmp_path: str) -> None:
    model = mlp()
    data = [(torch.randn(8), torch.tensor(i % 3)) for i in range(24)]
    state = ft.TrainState.create(model, ft.optim.sgd(0.1), seed=0)
    step = ft.jit(
        ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)), compile=False
    )
    ft.fit(state, step, data, batch_size=6, max_steps=2, progress_bar=False, checkpoints=str(tmp_path))
    manager = ft.checkpoint.CheckpointManager(str(tmp_path))
    assert manager.header(2).metadata["data_parallel"] == {
        "world_size": 1,
        "batch_size": 6,
        "global_batch_size": 6,
    }
    with pytest.raises(distributed.LayoutMismatchError, match="global batch of 6"):
        ft.fit(
            state,
            step,
            data,
            batch_size=4,
            max_steps=4,
            progress_bar=False,
            checkpoints=str(tmp_path),
            resume_from_checkpoint=True,
        )


def test_replicate_alone_moves_and_keeps_values() -> None:
    state = ft.TrainState.create(mlp(), ft.optim.adam(1e-3), seed=0)
    out = distributed.replicate(state, device="cpu")
    for k in state.params:
        assert torch.equal(out.params[k], state.params[k])
    distributed.assert_replicated(out)  # one process: trivially replicated, must not raise
