"""Sharded training (ZeRO-1/2/3) on 2 and 4 CPU processes (gloo) against one process on the union batch.

Launches (each rank computes the one-process reference itself; see ``sharding_worker.py``):
``parity`` on 2 and on 4 ranks (6 AdamW steps with clipping and weight decay, uneven batches, an empty
one on 4 ranks; accumulation; LAMB; a BatchNorm CNN; the guards), ``save`` on 2 ranks then ``resume`` on
2 and 4 (and 1, in this process), ``kill`` on 2, and ``compile`` once (marked ``compile``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import sharding_worker as worker
import torch

import functrain as ft
from functrain import distributed
from functrain.checkpoint import sharded as ckpt
from functrain.core.tree_walk import leaves_with_paths

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
F64 = 1e-12  # float64 parity
F32 = 1e-6  # what float32 arithmetic allows (loss and grad_norm are float32 metrics)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(
    mode: str,
    out_dir: str,
    world: int,
    *extra: str,
    check: bool = True,
    timeout: int = 600,
    script: str = "sharding_worker.py",
) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    # the functrain this test imports, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(ft.__file__)), env.get("PYTHONPATH", "")]
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
        f"--master_port={_free_port()}", os.path.join(HERE, script), mode, out_dir, *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if not check:
        return []
    assert proc.returncode == 0, f"torchrun {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(os.path.join(out_dir, f"{mode}_rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def parity(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun("parity", str(tmp_path_factory.mktemp(f"parity{request.param}")), request.param)


def _within(result: dict, tol: float) -> None:
    for key in ("params", "opt_state", "buffers"):
        assert result[key] <= tol, (key, result)
    assert result["loss"] <= F32 and result["grad_norm"] <= F32, result


@pytest.mark.parametrize("case", ["transformer/optimizer", "transformer/grads", "transformer/params"])
def test_each_level_equals_one_process_on_the_union_batch(parity: list[dict], case: str) -> None:
    for out in parity:  # every rank's gathered state
        _within(out[case], F64)


@pytest.mark.parametrize("level", ["optimizer", "grads", "params"])
def test_a_donating_sharded_step_gives_the_same_state(parity: list[dict], level: str) -> None:
    for out in parity:
        _within(out[f"transformer/{level}/donate"], F64)
        assert out[f"donate_vs_kept/{level}"] == 0.0, out[f"donate_vs_kept/{level}"]


@pytest.mark.parametrize("case", ["optimizer", "params", "params/blocks"])
def test_padded_batches_equal_one_process_on_the_real_rows(parity: list[dict], case: str) -> None:
    # each rank's part padded to 4 rows (pad_train_batches); on 4 ranks one rank's part is all padding
    for out in parity:
        _within(out[f"transformer/{case}/padded"], F64)


def test_accumulation_and_lamb_trust_ratio_are_exact(parity: list[dict]) -> None:
    for out in parity:
        _within(out["transformer/params/accumulate2"], F64)
        _within(out["lamb/params"], F64)


def test_batchnorm_cnn_equals_replicated_data_parallelism(parity: list[dict]) -> None:
    # BatchNorm normalises with each rank's batch statistics (as DDP without SyncBatchNorm) and the
    # running statistics are averaged over ranks: the reference is functrain's replicated data
    # parallelism, which reduces its gradients in float32, hence the float32 tolerance.
    for out in parity:
        _within(out["cnn/params_vs_ddp"], F32)


def test_evaluation_and_prediction_gather_the_zero3_params(parity: list[dict]) -> None:
    # eval and predict steps all-gather a ZeRO-3 state's shards (eager and compiled); the compiled step
    # runs other kernels than the eager reference: float32 metrics, float64 predictions at 1e-12
    for out in parity:
        for key, value in out["forward/params"].items():
            assert value <= (F32 if key.startswith("eval_loss") else F64), (key, value)


def test_each_rank_holds_one_world_th_of_every_param_and_moment(parity: list[dict]) -> None:
    world = parity[0]["world_size"]
    for out in parity:
        sizes = out["sizes/params"]
        assert any(k.startswith("params[") for k in sizes) and any(".mu[" in k for k in sizes)
        assert any(".nu[" in k for k in sizes)
        for where, (have, expected) in sizes.items():
            assert have == expected, where
        for level in ("optimizer", "grads"):
            assert not any(k.startswith("params[") for k in out[f"sizes/{level}"])  # params replicated
        # params + optimizer state: 1/world of the replicated run's, plus padding and the scalars
        assert out["state_bytes/params"] <= 1.1 * out["state_bytes/replicated"] / world + 512


def test_guards_catch_each_silent_failure(parity: list[dict]) -> None:
    # The failures of SHARDING_FACTS.md, put back on purpose: the parity check used above must see each.
    for out in parity:
        for name in ("zero_gradients", "unreduced_gradients", "local_norms"):
            assert out[f"guard/{name}"]["params"] > 1e-4, name
        assert out["guard/local_norms"]["grad_norm"] > 1e-3


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    out_dir = str(tmp_path_factory.mktemp("save"))
    _torchrun("save", out_dir, 2)
    return out_dir, os.path.join(out_dir, "ckpt")


def _leaves_equal(a: object, b: object) -> bool:
    """Bitwise, leaf by leaf (a state and its plain-container restore have the same paths)."""
    la, lb = leaves_with_paths(a), leaves_with_paths(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for (_, x), (_, y) in zip(la, lb)
    )


def test_checkpoint_without_process_group_is_the_whole_state_bitwise(saved: tuple[str, str]) -> None:
    _, directory = saved
    reference = ft.checkpoint.restore(os.path.join(directory, "reference.ckpt"))
    assert ckpt.latest_sharded(directory) == 3
    assert _leaves_equal(ckpt.restore_sharded(directory), reference)


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_of_2_ranks_resumes_on_2_and_4_bitwise(saved: tuple[str, str], world: int) -> None:
    out_dir, directory = saved
    results = _torchrun("resume", os.path.join(out_dir), world, directory)
    reference = ft.checkpoint.restore(os.path.join(directory, "reference.ckpt"))
    for out in results:
        assert _leaves_equal(ft.checkpoint.restore(out["restored"]), reference)
        for where, (have, expected) in out["sizes"].items():
            assert have == expected, where
    if world == 2:  # same world size: the resumed run continues bitwise as the uninterrupted one
        uninterrupted = ft.checkpoint.restore(os.path.join(directory, "uninterrupted_w2_rank0.ckpt"))
        assert _leaves_equal(ft.checkpoint.restore(results[0]["continued"]), uninterrupted)


def test_fit_resumes_a_sharded_run_bitwise_and_the_plain_manager_refuses_it(saved: tuple[str, str]) -> None:
    out_dir, _ = saved
    for r in range(2):
        out = torch.load(os.path.join(out_dir, f"save_rank{r}.pt"), weights_only=False)
        straight = ft.checkpoint.restore(out["fit_straight"])
        assert int(straight["step"]) == 6
        assert _leaves_equal(ft.checkpoint.restore(out["fit_resumed"]), straight)
        assert "ShardedCheckpointManager" in out["plain_manager_refused"]


def test_a_sharded_mismatch_names_whole_shapes_and_a_fit_file_says_what_it_holds(
    saved: tuple[str, str],
) -> None:
    out_dir, _ = saved
    for r in range(2):
        out = torch.load(os.path.join(out_dir, f"save_rank{r}.pt"), weights_only=False)
        lines = out["wider_resumed"].splitlines()
        weight = next((line for line in lines if "params['weight']" in line), out["wider_resumed"])
        # the whole shapes, then each side's rows on this rank (not the rows alone)
        assert "checkpoint torch.float32 [12, 16], model torch.float32 [14, 16]" in weight, weight
        assert "rows: checkpoint [6, 16], model [7, 16]" in weight, weight
        head = out["bare_restored"].splitlines()[0]
        assert "{'state', 'loop'}" in head and "target={'state': state})['state']" in head, head
        restored, saved = out["hinted_step"]  # what the hint says restores the train state
        assert restored == saved >= 1


def test_checkpoint_of_2_ranks_resumes_in_one_process(saved: tuple[str, str]) -> None:
    _, directory = saved
    model = worker.build(worker.Transformer, on_meta=False)
    sharding = distributed.fully_shard(level="params")
    template = ft.TrainState.create(model, worker.adamw(), seed=1, sharding=sharding)
    state = ckpt.restore_sharded(directory, target=template)
    reference = ft.checkpoint.restore(os.path.join(directory, "reference.ckpt"))
    assert _leaves_equal(state.layout.full_state(state), reference)
    plain = ckpt.restore_sharded(directory, target=ft.TrainState.create(model, worker.adamw(), seed=1))
    assert _leaves_equal(plain, reference)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path: str) -> None:
    out_dir = str(tmp_path)
    _torchrun("kill", out_dir, 2, check=False, timeout=300)
    directory = os.path.join(out_dir, "ckpt")
    step2 = os.path.join(directory, "step_0000000002.shards")
    assert os.path.isdir(step2) and not os.path.exists(os.path.join(step2, ckpt.MANIFEST))  # died mid-save
    assert any(".tmp-" in name for name in os.listdir(step2))  # rank 1's file was half written
    assert ckpt.latest_sharded(directory) == 1
    reference = ft.checkpoint.restore(os.path.join(directory, "reference.ckpt"))
    assert _leaves_equal(ckpt.restore_sharded(directory), reference)
    assert ckpt.remove_uncommitted(directory) == [2] and ckpt.sharded_steps(directory) == [1]


@pytest.mark.compile
def test_compiled_zero3_step_is_one_graph_and_matches_one_process(tmp_path: str) -> None:
    # Compiled once, ZeRO-3 with AdamW + clipping: one graph per rank (fullgraph). Clipping's factor is
    # a float32 norm (tree.global_norm), which inductor may round one ulp apart from eager: float32
    # tolerance on the float64 params.
    for out in _torchrun("compile", str(tmp_path), 2):
        assert out["num_compiles"] == 1
        _within(out["compiled/params"], F32)
