"""A run that stays on the eager tier (``compile: auto``) never imports ``torch._dynamo`` nor
``torch._inductor``: ~2 s of CPU that a short job would spend on a compiler it never uses. Each probe runs
in a fresh interpreter (these modules, once imported by any test, stay in ``sys.modules``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_MODEL = """
import sys
import torch
import functrain as ft

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))
x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
data = torch.utils.data.TensorDataset(x, y)
"""

_TRAINER = (
    _MODEL
    + """
trainer = ft.Trainer(
    model, {"output_dir": sys.argv[1], "epochs": 2, "batch_size": 4, "progress_bar": False},
    train_dataset=data, eval_dataset=data,
)
result = trainer.train()
train = trainer._jitted["train"]
print("STEPS", int(result.state.step), "TIER", train.tier, "DECIDED", train.plan.decided_at)
print("LOADED", sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""
)

_FIT = (
    _MODEL
    + """
from functrain.compile.tiers import tiered

state = ft.TrainState.create(model, ft.optim.adam(1e-2), seed=0)
step = tiered(ft.make_train_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy)))
result = ft.fit(state, step, data, batch_size=4, epochs=2, progress_bar=False)
print("STEPS", int(result.state.step), "TIER", step.tier, "DECIDED", step.plan.decided_at)
print("LOADED", sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""
)


def _run(probe: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", probe, str(tmp_path / "run")]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_trainer_on_the_eager_tier_imports_no_dynamo_nor_inductor(tmp_path: Path) -> None:
    out = _run(_TRAINER, tmp_path)
    assert "STEPS 20 TIER eager DECIDED 6" in out, out  # the policy decided, and stayed eager
    assert "LOADED []" in out, out


def test_fit_with_a_tiered_step_on_the_eager_tier_imports_no_dynamo_nor_inductor(tmp_path: Path) -> None:
    out = _run(_FIT, tmp_path)
    assert "STEPS 20 TIER eager DECIDED 6" in out, out
    assert "LOADED []" in out, out
