"""One compiled optimizer step: one graph while the count advances and hyperparameters change by hand."""

from __future__ import annotations

import pytest
import torch

from functrain import optim, tree


@pytest.mark.compile
def test_adamw_warmup_cosine_compiles_once_and_matches_eager(recording_inductor) -> None:  # type: ignore[no-untyped-def]
    compiles = recording_inductor.graphs
    torch._dynamo.reset()
    schedule = optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=8)
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(schedule, weight_decay=0.1, mask=lambda p: optim.mask_by_name(p, "*.weight")),
    )

    def step(params, grads, state):  # type: ignore[no-untyped-def]
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    compiled = torch.compile(step, fullgraph=True, backend=recording_inductor)
    g = torch.Generator().manual_seed(0)
    params = {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(4, generator=g)}
    eager_params, eager_state = params, tx.init(params)
    compiled_params, compiled_state = params, tx.init(params)
    logged = []
    for i in range(5):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        eager_params, eager_state = step(eager_params, grads, eager_state)
        compiled_params, compiled_state = compiled(compiled_params, grads, compiled_state)
        logged.append(float(optim.hyperparams(compiled_state)["learning_rate"]))
        if i == 2:  # a callback changing hyperparameters by hand
            changes = {"learning_rate_scale": 0.5, "weight_decay": 0.3}
            eager_state = optim.set_hyperparams(eager_state, **changes)
            compiled_state = optim.set_hyperparams(compiled_state, **changes)

    assert len(compiles) == 1
    expected_lrs = [float(schedule(i)) * (0.5 if i > 2 else 1.0) for i in range(5)]
    assert logged == pytest.approx(expected_lrs, rel=1e-6)
    assert int(compiled_state[1][0].count) == 5
    for ours, reference in zip(
        tree.leaves((compiled_params, compiled_state)), tree.leaves((eager_params, eager_state))
    ):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)
