"""Betas in the optimizer state (``betas_in_state=True``): listed and set like the learning rate, and
``torch.func.grad`` through unrolled steps w.r.t. them matches central finite differences in float64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_differentiable_training import Unrolled

from functrain import optim, tree
from functrain.optim import transforms

BETAS: dict[str, Callable[[], optim.GradientTransformation]] = {
    "adam": lambda: optim.adam(0.05, b1=0.8, b2=0.9, betas_in_state=True),
    "adamw": lambda: optim.adamw(0.05, b1=0.8, b2=0.9, weight_decay=0.1, betas_in_state=True),
    "adam_l2_amsgrad": lambda: optim.adam(
        0.05, b1=0.8, b2=0.9, weight_decay=0.1, amsgrad=True, betas_in_state=True
    ),
    "lamb": lambda: optim.lamb(0.05, b1=0.8, b2=0.9, weight_decay=0.1, betas_in_state=True),
}


@pytest.mark.parametrize("name", list(BETAS))
def test_grad_wrt_betas_through_unrolled_steps_matches_finite_differences(name: str) -> None:
    run = Unrolled(BETAS[name]())
    assert {"b1", "b2"} <= set(run.hyper)
    run.check(torch.func.grad(run.loss, argnums=(0, 1))(run.params, run.hyper))


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
def test_a_beta_read_as_a_float_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finite-difference check catches a ``float()`` on the path: the gradient through the bias
    correction is then silently dropped."""
    one_minus_pow = transforms._one_minus_pow
    monkeypatch.setattr(transforms, "_one_minus_pow", lambda base, count: one_minus_pow(float(base), count))
    run = Unrolled(BETAS["adam"]())
    with pytest.raises(AssertionError, match=r"b1|b2"):
        run.check((torch.func.grad(run.loss, argnums=1)(run.params, run.hyper),), argnums=(1,))


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: optim.adam(1e-2, **kw),
        lambda **kw: optim.adamw(1e-2, weight_decay=0.1, **kw),
        lambda **kw: optim.lamb(1e-2, weight_decay=0.1, **kw),
        lambda **kw: optim.lion(1e-3, **kw),
    ],
)
def test_betas_in_state_are_listed_set_and_used(make: Callable[..., optim.GradientTransformation]) -> None:
    """Listed only where asked; the same steps as the floats (float64); setting them changes the update."""
    params = {"w": torch.linspace(-1, 1, 5, dtype=torch.float64)}
    plain, in_state = make(b1=0.8, b2=0.95), make(b1=0.8, b2=0.95, betas_in_state=True)
    s_plain, s_state = plain.init(params), in_state.init(params)
    assert not {"b1", "b2"} & set(optim.hyperparams(s_plain))
    assert set(optim.hyperparams(s_state)) == set(optim.hyperparams(s_plain)) | {"b1", "b2"}
    assert optim.hyperparams(s_state)["b2"].dtype == torch.float64
    p_plain, p_state = params, params
    for k in range(3):
        g = torch.cos(torch.arange(5, dtype=torch.float64) * (k + 1))
        p_plain, s_plain = optim.apply_gradients(plain, {"w": g}, s_plain, p_plain)
        p_state, s_state = optim.apply_gradients(in_state, {"w": g}, s_state, p_state)
    torch.testing.assert_close(p_state["w"], p_plain["w"], rtol=1e-13, atol=1e-15)
    other = optim.set_hyperparams(s_state, b1=0.0, b2=0.5)
    g = {"w": torch.ones(5, dtype=torch.float64)}

    def moved(state: optim.OptState) -> list[torch.Tensor]:  # the update and the new moments
        return [x for x in tree.leaves(in_state.update(g, state, p_state)) if x.dim() > 0]

    assert any(not torch.equal(a, b) for a, b in zip(moved(other), moved(s_state)))


@pytest.mark.compile
def test_compiled_grad_wrt_betas_is_one_graph_and_matches(recording_inductor) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    run = Unrolled(BETAS["adamw"]())
    compiled = torch.compile(
        torch.func.grad(run.loss, argnums=(0, 1)), fullgraph=True, backend=recording_inductor
    )
    run.check(compiled(run.params, run.hyper))
    assert len(recording_inductor.graphs) == 1
