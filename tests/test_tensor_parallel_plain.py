"""The eager tensor-parallel step takes plain autograd (``functrain.step.grad``), bitwise what
``torch.func.grad_and_value`` gives, at a fraction of its peak memory (benchmarks/tensor_parallel.py).

One torchrun launch of ``tp_plain_worker.py`` (4 gloo ranks, float64): colwise, rowwise and embedding
(colwise and rowwise) splits, a weight tied to the head, a buffer, on the tp axis alone and on dp 2 x tp 2 at
every ZeRO level with 2 micro-batches, bf16 compute at ZeRO-3; each case 3 AdamW steps on the plain path and again with the plain
path refused, compared bitwise, and against one process.
"""

from __future__ import annotations

import pytest
from test_sharding_torchrun import _torchrun

pytestmark = pytest.mark.slow

TOL = 1e-10  # float64 after 3 AdamW steps: the split matmuls sum in another order than one process's


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun("plain", str(tmp_path_factory.mktemp("tp_plain")), 4, script="tp_plain_worker.py")


def test_the_eager_tp_step_takes_plain_autograd_bitwise_as_torch_func(plain: list[dict]) -> None:
    for out in plain:
        cases = [k for k in out if k.startswith(("tp/", "dp2xtp2/"))]
        assert len(cases) == 9, cases
        for key in cases:
            case = out[key]
            # every micro-batch's gradient by plain autograd; the transform once, the first call's check
            assert case["paths"] == {"plain": case["calls"], "transformed": 1}, (key, case)
            assert case["func_paths"] == {"plain": 0, "transformed": case["calls"]}, (key, case)
            assert case["state"] and case["metrics"], (key, case)  # params, moments, buffers, metrics
            if key != "dp2xtp2/params/bf16":  # bf16 compute rounds: bitwise torch.func's is the check
                assert case["one_process"] <= TOL, (key, case)


def test_a_gradient_of_dtensor_params_is_torch_funcs_bitwise_placements_included(plain: list[dict]) -> None:
    for out in plain:
        for name in ("gpt", "tied_colwise", "tied_rowwise"):
            assert out[f"grad/{name}"] == {"bitwise": True, "dtensors": True, "names": True}, (name, out)


def test_only_a_dtensor_of_a_plain_tensor_that_needs_no_grad_takes_plain_autograd(plain: list[dict]) -> None:
    for out in plain:
        assert out["applies"] == {
            "dtensor": True,
            "dtensor_requires_grad": False,
            "dtensor_of_subclass": False,
            "subclass": False,
        }, out["applies"]
