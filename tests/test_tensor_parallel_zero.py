"""Tensor parallelism with ZeRO over the dp axis of a 2-D mesh (dp 2 x tp 2, 4 gloo ranks, float64) against
one process on the global batches.

One torchrun launch per mode of ``tp_zero_worker.py``: ``eager`` (levels none/optimizer/grads/params, 8
AdamW steps with clipping; bytes at rest; gather -> place; the eval forward; the refusals; bf16 compute
with float32 masters) and, marked ``compile``, ``compile`` (levels none/optimizer/params compiled in one
process: the same parity, one compile each).
"""

from __future__ import annotations

import pytest
from test_sharding_torchrun import _torchrun

pytestmark = pytest.mark.slow

TOL = 1e-10  # float64 after 8 AdamW steps: the split matmuls sum in another order
F32 = 1e-6  # loss and grad_norm are float32 metrics
LEVELS = ("None", "optimizer", "grads", "params")
COMPILED = ("None", "optimizer", "params")


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun("eager", str(tmp_path_factory.mktemp("tp_zero")), 4, script="tp_zero_worker.py")


def _equal_to_one_process(out: dict) -> None:
    for key in ("params", "opt_state", "state_dict"):
        assert out[key] <= TOL, (key, out)
    assert out["loss"] <= F32 and out["grad_norm"] <= F32, out
    assert out["clipped"] == (out["clip"] < 1), out  # clipping active: the norm over all row pieces counts
    assert out["num_params"], out


@pytest.mark.parametrize("level", LEVELS)
def test_tp2_by_dp2_with_zero_equals_one_process_on_the_global_batch(eager: list[dict], level: str) -> None:
    for out in eager:
        _equal_to_one_process(out[level])
        # the gathered state placed again is this rank's layout, bitwise; the eval step sees whole params
        assert out[level]["replace"] == 0.0 and out[level]["eval"] <= TOL, out[level]


def test_zero3_keeps_a_quarter_of_the_state_per_rank_at_rest(eager: list[dict]) -> None:
    tp, dp = 2, 2
    for out in eager:
        # params + AdamW moments, bytes of the local parts against one process's whole state (padding
        # rows of the 13-row embedding and head make up the rest)
        assert out["params"]["bytes_ratio"] <= 1.1 / (tp * dp), out["params"]
        assert out["params"]["params_ratio"] <= 1.1 / (tp * dp), out["params"]
        # ZeRO-1/2: the moments a quarter, the params split over tp only (half of the split layers)
        for level in ("optimizer", "grads"):
            assert out[level]["bytes_ratio"] < out["None"]["bytes_ratio"], (level, out[level], out["None"])
            assert out[level]["params_ratio"] == out["None"]["params_ratio"], (level, out[level])


def test_what_zero_under_tp_cannot_do_right_is_refused_with_the_reason(eager: list[dict]) -> None:
    refused = eager[0]["refusals"]
    assert "blocks" in refused["blocks"] and "setup_context" in refused["blocks"], refused
    assert "param_dtype" in refused["param_dtype"] and "precision='bf16'" in refused["param_dtype"], refused
    assert "fully_shard(mesh['dp']" in refused["world"], refused
    assert "this mesh is 1-D" in refused["one_d"], refused
    assert "not the shape of param 'embed.weight'" in refused["factored"], refused


def test_bf16_compute_with_float32_masters_is_as_close_to_float32_as_one_process_in_bf16(
    eager: list[dict],
) -> None:
    for out in eager:
        bf16 = out["bf16"]
        assert bf16["masters"] == ["torch.float32"], bf16  # params and moments stay float32
        # bf16 keeps 8 significant bits: the loss within 2^-8 (one rounding) of the float32 run's
        assert bf16["loss"] <= 2**-8 and bf16["one_process_loss"] <= 2**-8, bf16
        # AdamW moves a param by ~lr per step whatever the gradient's size, so bf16's rounding of small
        # gradients moves params by up to ~lr * steps; TP x ZeRO-3 adds nothing to what one process in
        # bf16 already differs by (a wrong split or reduction would be far off both)
        assert bf16["params"] <= 1.5 * bf16["one_process_params"], bf16


@pytest.mark.compile
def test_tp2_by_dp2_with_zero_compiled_equals_one_process_with_one_compile(tmp_path: str) -> None:
    # the levels compile one after another in one process (each its own strategy on mesh["tp"]): the
    # second compile used to fail in inductor (a device_mesh._get_submesh node), and was refused
    # three compiles of a 2-block GPT on 4 ranks: ~7 min each on 2 busy cores
    for out in _torchrun("compile", str(tmp_path), 4, script="tp_zero_worker.py", timeout=2400):
        for level in COMPILED:
            _equal_to_one_process(out[level])
            assert out[level]["num_compiles"] == 1, (level, out[level])
