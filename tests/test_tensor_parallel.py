"""Tensor parallelism (DTensor params by a plan) on 2 and 4 CPU processes (gloo) against one process.

One torchrun launch per mode of ``tp_worker.py`` (each rank computes the one-process reference itself):
``eager`` (8 AdamW steps with clipping on a GPT-style model, heads split; the plan's refusals; the
checkpoint of a gathered state, resumed; the Hugging Face plans), ``grid`` (4 ranks, dp 2 x tp 2), and,
marked ``compile``, ``compile`` (the step compiled once per rank, then another optimizer and the first
again after ``torch._dynamo.reset()`` in the same process) and ``grid_compile``.
"""

from __future__ import annotations

import pytest
import tp_worker as worker
from test_sharding_torchrun import _torchrun

import functrain as ft

pytestmark = pytest.mark.slow

TOL = 1e-10  # float64 after 8 AdamW steps: the split matmuls sum in another order
F32 = 1e-6  # loss and grad_norm are float32 metrics


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun("eager", str(tmp_path_factory.mktemp("tp_eager")), 2, script="tp_worker.py")


def _equal_to_one_process(out: dict) -> None:
    for key in ("params", "opt_state", "state_dict"):
        assert out[key] <= TOL, (key, out)
    assert out["loss"] <= F32 and out["grad_norm"] <= F32, out
    assert out["split"] == 20, out  # q, k, v, fc (weight, bias), attn.proj, mlp.proj (weight) of 2 blocks
    assert out["moments_dtensor"] and out["metrics_plain"], out
    assert out["clipped"] == (out["clip"] < 1), out  # clipping active: the norm over the split leaves counts


def test_tp2_equals_one_process_on_the_same_batches(eager: list[dict]) -> None:
    for out in eager:
        _equal_to_one_process(out["eager"])


def test_a_plan_that_cannot_be_applied_is_refused_naming_the_module(eager: list[dict]) -> None:
    refused = eager[0]["refusals"]
    assert "'blocks.0.ln1', a LayerNorm" in refused["not_splittable"], refused
    assert "'blocks.*.attn.query' matches no submodule" in refused["no_match"], refused
    assert "'columnwise'" in refused["bad_style"], refused
    assert "'head.weight' has 13 along dim 0" in refused["indivisible"], refused
    assert "fp16 loss scaling is not supported" in refused["fp16"], refused
    # a state sharded by TrainState.create(sharding=) is refused; ZeRO under TP is tensor_parallel(sharding=)
    assert "tensor_parallel(model, plan, mesh, sharding=fully_shard(mesh['dp']" in refused["zero"], refused


def test_tp2_by_dp2_equals_one_process_on_the_global_batch(tmp_path: str) -> None:
    # 4 ranks, a 2-D mesh: each dp rank its half of the global batch, its tp pair splitting the heads
    for out in _torchrun("grid", str(tmp_path), 4, script="tp_worker.py"):
        _equal_to_one_process(out["grid"])
        assert out["own_mesh"] is True, out  # strategies on mesh2d["tp"] share one mesh object


@pytest.mark.compile
def test_compiled_tp2_equals_one_process_and_compiles_once_each_time(tmp_path: str) -> None:
    for out in _torchrun("compile", str(tmp_path), 2, script="tp_worker.py"):
        _equal_to_one_process(out["compiled"])
        # another optimizer (clipping active) compiled after torch._dynamo.reset() in the same process: its
        # float32 clip factor rounds one ulp away from one process's (grad_norm's F32), AdamW makes that 2e-9
        assert out["variant"]["params"] <= 1e-8 and out["variant"]["grad_norm"] <= F32, out["variant"]
        # then the first step compiled a third time: as right as the first time
        _equal_to_one_process(out["recompiled"])
        for run in ("compiled", "variant", "recompiled"):
            assert out[run]["num_compiles"] == 1, (run, out[run])


@pytest.mark.compile
def test_compiled_tp2_by_dp2_equals_one_process_and_compiles_once(tmp_path: str) -> None:
    for out in _torchrun("grid_compile", str(tmp_path), 4, script="tp_worker.py"):
        _equal_to_one_process(out["grid"])
        assert out["grid"]["num_compiles"] == 1, out["grid"]


def test_a_gathered_checkpoint_resumes_bitwise_on_tp2_and_on_one_process(eager: list[dict]) -> None:
    for out in eager:
        resume = out["resume"]
        assert resume["dtensor_save"] == 0.0, resume  # a placed state is saved whole (it was refused)
        assert resume["roundtrip"] == 0.0 and resume["resumed_vs_uninterrupted"] == 0.0, resume
    # the file the 2 ranks wrote, on one process: the same 4 last steps
    net = worker.model()
    target = ft.TrainState.create(net, worker.adamw())
    state = ft.checkpoint.restore(eager[0]["resume"]["path"], target=target)
    assert int(state.step) == 4
    step = ft.make_train_step(net, worker.lm_loss)
    for batch in worker.batches()[4:]:
        state, _ = step(state, batch)
    final = eager[0]["resume"]["final"]
    assert max((state.params[k] - final[k]).abs().max().item() for k in final) <= TOL


def test_the_hugging_face_plans_split_gpt2_and_llama_and_dropout_is_refused(eager: list[dict]) -> None:
    pytest.importorskip("transformers")
    hf = eager[0]["hf"]
    assert hf["gpt2/split"] == 12 and hf["llama/split"] == 14, (
        hf
    )  # c_attn, c_fc (w, b), c_proj (w); q/k/v/o...
    assert hf["gpt2"] <= TOL, hf
    # Llama's RMSNorm computes in float32 whatever the params' dtype: its rounding of inputs that differ by
    # 1e-16 (the split sums) leaves 2e-9 after 3 SGD steps; a wrong split would be 1e-1
    assert hf["llama"] <= 1e-7, hf
    assert "the model has dropout" in hf["dropout"] and "attn_dropout (p=0.1)" in hf["dropout"], hf
