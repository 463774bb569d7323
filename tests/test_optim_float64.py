"""float64 parity: functrain's optimizers against torch.optim, 100 steps on the same gradients.

In float64 the hyperparameters are held and applied in float64 (the params' dtype) and Adam's bias
corrections follow torch's order of operations, so each optimizer stays within ``TOL`` = 1e-14 (max abs
difference) of every torch.optim implementation of it: single-tensor (``foreach=False``), ``foreach=True``
and ``fused=True`` where torch has it. ``adam``/``adamw`` with ``fused=True`` call the same fused kernel as
``torch.optim.AdamW(fused=True)`` and agree with it exactly (0.0, asserted).

torch.optim has no Lion: it is compared with the paper's update (Chen et al. 2023, Algorithm 2) written
below in plain float64 torch ops.

Eager only: float64 eager is deterministic, and the compiled step's arithmetic is covered at float32
tolerances elsewhere (tests/test_optim_compile.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from functrain import optim

STEPS = 100
TOL = 1e-14

Params = dict[str, torch.Tensor]


def _params() -> Params:
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (7, 5), "b": (13,), "s": ()}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def _grads(params: Params) -> list[Params]:
    """STEPS deterministic gradients, of growing and shrinking size (so moments and signs move)."""
    g = torch.Generator().manual_seed(1)
    return [
        {
            k: torch.randn(p.shape, generator=g, dtype=torch.float64) * (1 + step % 7)
            for k, p in params.items()
        }
        for step in range(STEPS)
    ]


def _ours(tx: optim.GradientTransformation, params: Params, grads: list[Params]) -> Params:
    state = tx.init(params)
    for g in grads:
        params, state = optim.apply_gradients(tx, g, state, params)
    return params


def _torch(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    params: Params,
    grads: list[Params],
    lrs: list[float] | None = None,
    scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
) -> Params:
    """torch.optim's run on the same gradients; ``lrs`` sets each step's lr by hand, ``scheduler`` steps one."""
    ps = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = make(list(ps.values()))
    sched = scheduler(opt) if scheduler is not None else None
    for step, g in enumerate(grads):
        for k, p in ps.items():
            p.grad = g[k].clone()
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        opt.step()
        if sched is not None:
            sched.step()  # type: ignore[attr-defined]
    return {k: p.detach() for k, p in ps.items()}


def _max_abs_diff(a: Params, b: Params) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# Each torch.optim implementation of an algorithm: single-tensor, foreach, fused.
IMPLEMENTATIONS = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _check(ours: Params, reference: Params, what: str, exact: bool = False) -> None:
    diff = _max_abs_diff(ours, reference)
    print(f"{what}: max abs diff {diff:.3g}")
    assert all(v.dtype == torch.float64 for v in ours.values())
    assert diff <= (0.0 if exact else TOL), (
        f"{what}: max abs diff {diff:.3g} (allowed {0.0 if exact else TOL})"
    )


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_float64_matches_torch(fused: bool, weight_decay: float) -> None:
    params = _params()
    grads = _grads(params)
    ours = _ours(optim.adamw(1e-2, b1=0.8, b2=0.95, weight_decay=weight_decay, fused=fused), params, grads)
    for impl, kwargs in IMPLEMENTATIONS.items():
        reference = _torch(
            lambda ps, kwargs=kwargs: torch.optim.AdamW(
                ps, lr=1e-2, betas=(0.8, 0.95), weight_decay=weight_decay, **kwargs
            ),
            params,
            grads,
        )
        _check(
            ours,
            reference,
            f"adamw(fused={fused}, wd={weight_decay}) vs torch {impl}",
            fused and impl == "fused",
        )


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_adam_float64_matches_torch(fused: bool, amsgrad: bool) -> None:
    """Adam with L2 weight decay (added to the gradient), and with amsgrad."""
    params = _params()
    grads = _grads(params)
    ours = _ours(optim.adam(3e-3, weight_decay=0.05, amsgrad=amsgrad, fused=fused), params, grads)
    for impl, kwargs in IMPLEMENTATIONS.items():
        reference = _torch(
            lambda ps, kwargs=kwargs: torch.optim.Adam(
                ps, lr=3e-3, weight_decay=0.05, amsgrad=amsgrad, **kwargs
            ),
            params,
            grads,
        )
        _check(ours, reference, f"adam(fused={fused}, amsgrad={amsgrad}) vs torch {impl}")


@pytest.mark.parametrize(
    ("momentum", "nesterov", "weight_decay"),
    [(0.0, False, 0.0), (0.9, False, 0.0), (0.9, True, 0.0), (0.9, False, 0.01), (0.9, True, 0.01)],
    ids=["plain", "momentum", "nesterov", "momentum-wd", "nesterov-wd"],
)
def test_sgd_float64_matches_torch(momentum: float, nesterov: bool, weight_decay: float) -> None:
    params = _params()
    grads = _grads(params)
    ours = _ours(
        optim.sgd(1e-2, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay), params, grads
    )
    for impl, kwargs in IMPLEMENTATIONS.items():
        reference = _torch(
            lambda ps, kwargs=kwargs: torch.optim.SGD(
                ps, lr=1e-2, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, **kwargs
            ),
            params,
            grads,
        )
        _check(
            ours,
            reference,
            f"sgd(momentum={momentum}, nesterov={nesterov}, wd={weight_decay}) vs torch {impl}",
        )


def _lion_reference(
    params: Params, grads: list[Params], lr: float, b1: float, b2: float, wd: float
) -> Params:
    """Lion as in the paper (Chen et al. 2023, Algorithm 2), float64, plain torch ops:
    ``c = b1 m + (1 - b1) g``, ``p = p - lr (sign(c) + wd p)``, ``m = b2 m + (1 - b2) g``."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        for k in p:
            c = b1 * m[k] + (1 - b1) * g[k]
            p[k] = p[k] - lr * (torch.sign(c) + wd * p[k])
            m[k] = b2 * m[k] + (1 - b2) * g[k]
    return p


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_float64_matches_the_papers_update(weight_decay: float) -> None:
    """torch.optim has no Lion: the reference is the paper's update in float64 torch ops."""
    params = _params()
    grads = _grads(params)
    ours = _ours(optim.lion(1e-3, b1=0.9, b2=0.99, weight_decay=weight_decay), params, grads)
    reference = _lion_reference(params, grads, 1e-3, 0.9, 0.99, weight_decay)
    _check(ours, reference, f"lion(wd={weight_decay}) vs the paper's update")


def _warmup_cosine(step: int, peak: float, warmup: int, total: int) -> float:
    """optax's warmup_cosine_decay_schedule(0, peak, warmup, total) at ``step``, in Python floats."""
    if step < warmup:
        return peak * step / warmup
    t = min(step - warmup, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * t / (total - warmup)))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_scheduled_adamw_float64_matches_torch(fused: bool) -> None:
    """A warmup-cosine schedule, against torch with each step's lr set by hand (Python floats)."""
    params = _params()
    grads = _grads(params)
    schedule = optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=10, decay_steps=80)
    ours = _ours(optim.adamw(schedule, weight_decay=0.1, fused=fused), params, grads)
    lrs = [_warmup_cosine(s, 1e-2, 10, 80) for s in range(STEPS)]
    for impl, kwargs in IMPLEMENTATIONS.items():
        reference = _torch(
            lambda ps, kwargs=kwargs: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kwargs),
            params,
            grads,
            lrs,
        )
        _check(ours, reference, f"adamw(warmup_cosine, fused={fused}) vs torch {impl}")


def test_scheduled_sgd_float64_matches_torch_cosine_annealing() -> None:
    """cosine_decay_schedule against torch.optim.lr_scheduler.CosineAnnealingLR (T_max = the 100 steps)."""
    params = _params()
    grads = _grads(params)
    ours = _ours(optim.sgd(optim.cosine_decay_schedule(0.01, STEPS), momentum=0.9), params, grads)
    for impl, kwargs in IMPLEMENTATIONS.items():
        reference = _torch(
            lambda ps, kwargs=kwargs: torch.optim.SGD(ps, lr=0.01, momentum=0.9, **kwargs),
            params,
            grads,
            scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
        )
        _check(ours, reference, f"sgd(cosine_decay) vs torch {impl} + CosineAnnealingLR")


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_mixed_float32_and_float64_params(fused: bool) -> None:
    """One model with float32 and float64 leaves: each keeps its dtype; the float64 leaf matches torch to
    1e-14, the float32 one to float32 precision (its hyperparameters are the float64 ones, rounded once)."""
    params = _params()
    params["w"] = params["w"].float()
    grads = [{k: v.to(params[k].dtype) for k, v in g.items()} for g in _grads(params)]
    tx = optim.adamw(1e-2, weight_decay=0.1, fused=fused)
    assert optim.hyperparams(tx.init(params))["learning_rate"].dtype == torch.float64
    ours = _ours(tx, params, grads)
    reference = _torch(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), params, grads
    )
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in params.items()}
    assert max(float((ours[k] - reference[k]).abs().max()) for k in ("b", "s")) <= TOL
    torch.testing.assert_close(ours["w"], reference["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_float32_and_bfloat16_keep_float32_hyperparameters(fused: bool) -> None:
    """Without float64 leaves nothing changes: float32 hyperparameters and step math, bf16 leaves stay
    bf16 and follow torch.optim at bf16 precision."""
    params = {k: v.float() for k, v in _params().items()}
    params["w"] = params["w"].bfloat16()
    grads = [{k: v.to(params[k].dtype) for k, v in g.items()} for g in _grads(params)[:20]]
    tx = optim.adamw(1e-2, weight_decay=0.1, fused=fused)
    assert {v.dtype for v in optim.hyperparams(tx.init(params)).values()} == {torch.float32}
    ours = _ours(tx, params, grads)
    reference = _torch(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), params, grads
    )
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in params.items()}
    torch.testing.assert_close(ours["b"], reference["b"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["w"].float(), reference["w"].float(), rtol=2e-2, atol=2e-2)


def test_float64_state_holds_exact_hyperparameters() -> None:
    """A state built from float64 params holds the rates as given (not their float32 roundings), and
    set_hyperparams keeps them float64."""
    import functrain as ft

    model = torch.nn.Linear(3, 2)
    state = ft.TrainState.create(model, optim.adamw(1e-3, weight_decay=0.1), dtype=torch.float64)
    values = optim.hyperparams(state.opt_state)
    assert {k: (v.dtype, float(v)) for k, v in values.items()} == {
        "learning_rate": (torch.float64, 1e-3),
        "weight_decay": (torch.float64, 0.1),
    }
    changed = optim.hyperparams(optim.set_hyperparams(state.opt_state, learning_rate=3e-4))["learning_rate"]
    assert changed.dtype == torch.float64 and float(changed) == 3e-4
    scheduled = optim.sgd(optim.cosine_decay_schedule(0.1, 10)).init(state.params)
    assert float(optim.hyperparams(scheduled)["learning_rate"]) == 0.1


def test_adagrad_with_lr_decay_float64_matches_torch() -> None:
    """Adagrad's lr_decay is a schedule computed in float64 for float64 params, as torch's (in double)."""
    params = _params()
    grads = _grads(params)
    ours = _ours(optim.adagrad(1e-2, lr_decay=0.01, weight_decay=0.01), params, grads)
    for impl, kwargs in IMPLEMENTATIONS.items():
        reference = _torch(
            lambda ps, kwargs=kwargs: torch.optim.Adagrad(
                ps, lr=1e-2, lr_decay=0.01, weight_decay=0.01, **kwargs
            ),
            params,
            grads,
        )
        _check(ours, reference, f"adagrad(lr_decay=0.01) vs torch {impl}")


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_schedule_of_a_state_cast_to_bfloat16_still_computes_in_float32(fused: bool) -> None:
    """``TrainState.to(dtype=torch.bfloat16)`` casts the hyperparameters too; the schedule is still
    evaluated in float32 (a bf16 count would stall at 256), as before float64 support."""
    import functrain as ft

    schedule = optim.linear_schedule(1.0, 0.0, transition_steps=1000)
    tx = optim.adamw(schedule, fused=fused)
    state = ft.TrainState.create(torch.nn.Linear(2, 1), tx).to(dtype=torch.bfloat16)
    *rest, lr_state = state.opt_state
    opt_state = (*rest, lr_state.replace(count=torch.tensor(257)))
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    _, new = optim.apply_gradients(tx, grads, opt_state, state.params)
    assert float(optim.hyperparams(new)["learning_rate"]) == pytest.approx(1 - 257 / 1000, rel=1e-6)
