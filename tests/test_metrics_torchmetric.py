"""functrain.metrics.torchmetric: torchmetrics states accumulated functionally equal torchmetrics itself."""

from __future__ import annotations

import pytest
import torch
import torchmetrics

from functrain import metrics
from functrain.metrics.registry import TESTED_TORCHMETRICS

N, C = 45, 4
MULTICLASS = {"task": "multiclass", "num_classes": C}
# name -> (arguments, kind of data); one entry per name in TESTED_TORCHMETRICS.
CASES = {
    "Accuracy": ({**MULTICLASS, "average": "macro"}, "multiclass"),
    "CohenKappa": (MULTICLASS, "multiclass"),
    "ConfusionMatrix": (MULTICLASS, "multiclass"),
    "CriticalSuccessIndex": ({"threshold": 0.5}, "regression"),
    "ExactMatch": (MULTICLASS, "multiclass"),
    "ExplainedVariance": ({}, "regression"),
    "F1Score": ({**MULTICLASS, "average": "macro"}, "multiclass"),
    "FBetaScore": ({**MULTICLASS, "beta": 2.0}, "multiclass"),
    "HammingDistance": (MULTICLASS, "multiclass"),
    "JaccardIndex": (MULTICLASS, "multiclass"),
    "LogCoshError": ({}, "regression"),
    "MatthewsCorrCoef": (MULTICLASS, "multiclass"),
    "MeanAbsoluteError": ({}, "regression"),
    "MeanAbsolutePercentageError": ({}, "regression"),
    "MeanSquaredError": ({}, "regression"),
    "MeanSquaredLogError": ({}, "regression"),
    "MinkowskiDistance": ({"p": 3.0}, "regression"),
    "Precision": ({**MULTICLASS, "average": "macro"}, "multiclass"),
    "R2Score": ({}, "regression"),
    "Recall": ({**MULTICLASS, "average": "weighted"}, "multiclass"),
    "RelativeSquaredError": ({}, "regression"),
    "Specificity": (MULTICLASS, "multiclass"),
    "StatScores": ({**MULTICLASS, "average": None}, "multiclass"),
    "SymmetricMeanAbsolutePercentageError": ({}, "regression"),
    "TweedieDevianceScore": ({}, "regression"),
}
EXTRA = {
    "F1Score-binary": ("F1Score", {"task": "binary"}, "binary"),
    "Precision-multilabel": ("Precision", {"task": "multilabel", "num_labels": 3}, "multilabel"),
}


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if kind == "multiclass":
        return torch.randn(N, C, generator=gen), torch.randint(0, C, (N,), generator=gen)
    if kind == "binary":
        return torch.randn(N, generator=gen), torch.randint(0, 2, (N,), generator=gen)
    if kind == "multilabel":
        return torch.randn(N, 3, generator=gen), torch.randint(0, 2, (N, 3), generator=gen)
    return torch.rand(N, generator=gen) + 0.1, torch.rand(N, generator=gen) + 0.1


def _accumulate(metric, preds, target, rows):
    state = metric.empty()
    for r in rows:
        state = metric.update(state, preds=preds[r], target=target[r])
    return state


ALL = {**{n: (n, *CASES[n]) for n in CASES}, **EXTRA}


def test_every_tested_name_has_a_case() -> None:
    assert set(CASES) == set(TESTED_TORCHMETRICS)


@pytest.mark.parametrize("case", sorted(ALL))
def test_batchwise_and_merged_equal_torchmetrics_on_the_whole_set(case: str) -> None:
    name, arguments, kind = ALL[case]
    preds, target = _data(kind)
    metric = metrics.from_torchmetrics(name, **arguments)
    rows = [slice(i, min(i + 8, N)) for i in range(0, N, 8)]  # last batch has 5 examples
    reference = getattr(torchmetrics, name)(**arguments)(preds, target)

    whole = metric.compute(_accumulate(metric, preds, target, rows))
    merged = metric.compute(
        metric.merge(
            _accumulate(metric, preds, target, rows[:2]), _accumulate(metric, preds, target, rows[2:])
        )
    )
    assert whole.shape == reference.shape
    assert torch.allclose(whole.double(), reference.double(), atol=1e-6)
    assert torch.allclose(merged.double(), reference.double(), atol=1e-6)


def test_state_is_torchmetrics_own_states_and_reductions() -> None:
    mse = metrics.from_torchmetrics("MeanSquaredError")
    assert set(mse.empty()) == {"sum_squared_error", "total"}
    assert mse.reductions() == {"sum_squared_error": "sum", "total": "sum"}
    confmat = metrics.from_torchmetrics("ConfusionMatrix", task="multiclass", num_classes=3)
    state = confmat.update(
        confmat.empty(), preds=torch.tensor([0, 1, 2, 2]), target=torch.tensor([0, 1, 1, 2])
    )
    assert state["confmat"].tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 1]]


def test_update_does_not_mutate_incoming_state() -> None:
    mse = metrics.from_torchmetrics("MeanSquaredError")  # torchmetrics adds to these states in place
    empty = mse.empty()
    mse.update(empty, preds=torch.ones(3), target=torch.zeros(3))
    assert float(empty["sum_squared_error"]) == 0.0 and int(empty["total"]) == 0


def test_unsupported_metrics_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"list that grows.*thresholds=100"):
        metrics.from_torchmetrics("AUROC", task="multiclass", num_classes=3)
    with pytest.raises(ValueError, match="not sum/max/min"):
        metrics.from_torchmetrics("PearsonCorrCoef")
    with pytest.raises(ValueError, match=r"did you mean.*MeanSquaredError"):
        metrics.from_torchmetrics("MeanSquareError")
    with pytest.raises(ValueError, match=r"F1Score\(.*could not be built"):
        metrics.from_torchmetrics("F1Score", task="multiclass")
    with pytest.raises(TypeError, match="needs input 'target'"):
        mse = metrics.from_torchmetrics("MeanSquaredError")
        mse.update(mse.empty(), preds=torch.ones(2))


def test_binned_auroc_is_exact_eagerly() -> None:
    preds, target = _data("multiclass")
    auroc = metrics.from_torchmetrics("AUROC", task="multiclass", num_classes=C, thresholds=20)
    rows = [slice(i, min(i + 8, N)) for i in range(0, N, 8)]
    reference = torchmetrics.AUROC(task="multiclass", num_classes=C, thresholds=20)(preds, target)
    assert torch.allclose(auroc.compute(_accumulate(auroc, preds, target, rows)), reference, atol=1e-6)


@pytest.mark.compile
def test_every_tested_update_traces_in_one_fullgraph() -> None:
    """Dynamo tracing only (backend="eager"): no graph break in any tested torchmetrics update."""
    cases = {case: ALL[case] for case in ALL}
    built = {
        case: metrics.from_torchmetrics(name, **arguments) for case, (name, arguments, _) in cases.items()
    }
    data = {case: tuple(t[:8] for t in _data(kind)) for case, (_, _, kind) in cases.items()}

    def update_all(states):
        return {
            case: m.update(states[case], preds=data[case][0], target=data[case][1])
            for case, m in built.items()
        }

    torch._dynamo.reset()
    states = {case: m.empty() for case, m in built.items()}
    traced = torch.compile(update_all, backend="eager", fullgraph=True)(states)
    eager = update_all(states)
    for case in cases:  # bitwise: backend="eager" runs the traced graph with eager's own kernels
        for key in eager[case]:
            assert torch.equal(traced[case][key], eager[case][key]), (case, key)


def test_the_adapter_imports_no_private_torchmetrics_names():
    """Private helpers move between torchmetrics releases; the adapter uses public names only."""
    import ast
    import inspect as _inspect

    from functrain.metrics import torchmetric

    tree = ast.parse(_inspect.getsource(torchmetric))
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchmetrics")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
