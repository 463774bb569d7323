"""Tensor parallelism combined with what a user combines it with, against one process (float64, 2 gloo ranks).

One torchrun launch of ``tp_review_worker.py`` runs every check: gradient accumulation, a weight-decay
mask, frozen params, EMA, remat, SAM, a head tied to a split or replicated embedding, a weight used twice
(colwise and rowwise), a BatchNorm on a replicated input with an int buffer, a padded batch; per-example gradients and
DP-SGD are refused.
"""

from __future__ import annotations

import pytest
from test_sharding_torchrun import _torchrun

pytestmark = pytest.mark.slow

TOL = 1e-10  # float64 after 3 AdamW steps: the split matmuls sum in another order

RIGHT = (
    "accumulate", "masked_decay", "freeze", "ema", "remat", "sam", "tied_head_colwise", "tied_embed_colwise",
    "twice_no_norm", "norm_replicated_input", "weight_twice_rowwise", "padded",
)  # fmt: skip


@pytest.fixture(scope="module")
def review(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _torchrun("review", str(tmp_path_factory.mktemp("tp_review")), 2, script="tp_review_worker.py")


@pytest.mark.parametrize("check", RIGHT)
def test_tp2_combined_equals_one_process(review: list[dict], check: str) -> None:
    for out in review:
        assert isinstance(out[check], float) and out[check] <= TOL, (check, out[check])


@pytest.mark.parametrize("check", ["per_example", "dpsgd"])
def test_per_example_gradients_under_tp_are_refused(review: list[dict], check: str) -> None:
    for out in review:
        assert "per_example with the parallel strategy TensorParallel" in str(out[check]), out[check]
