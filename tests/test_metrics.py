"""functrain.metrics: Average, Accuracy, Collection, metric_from_spec."""

from __future__ import annotations

import pytest
import torch
import torchmetrics

from functrain import metrics, tree


def _batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@pytest.fixture
def classification() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(53, 5, generator=gen), torch.randint(0, 5, (53,), generator=gen)


def test_average_weighted_by_examples_equals_float64_mean() -> None:
    gen = torch.Generator().manual_seed(1)
    per_example = torch.rand(53, generator=gen, dtype=torch.float64) * 10
    avg = metrics.Average("loss")
    state = avg.empty()
    for rows in _batches(53, 8):  # last batch has 5 examples
        chunk = per_example[rows]
        state = avg.update(state, loss=chunk.mean().float(), num_examples=torch.tensor(len(chunk)))
    expected = per_example.mean().item()
    batch_means = torch.stack([per_example[r].mean() for r in _batches(53, 8)]).mean().item()
    assert abs(float(avg.compute(state)) - expected) < 1e-5
    assert abs(batch_means - expected) > 1e-3  # the test would catch a mean of batch means


def test_average_per_example_values_with_mask_and_pytree_state() -> None:
    avg = metrics.Average("loss")
    state = avg.update(avg.empty(), loss=torch.tensor([1.0, 3.0, 100.0]), mask=torch.tensor([1, 1, 0]))
    assert float(avg.compute(state)) == 2.0
    assert len(tree.leaves(state)) == 2
    assert tree.leaves(avg.reductions()) == ["sum", "sum"]
    assert torch.isnan(avg.compute(avg.empty()))


def test_average_missing_input_names_what_it_got() -> None:
    with pytest.raises(TypeError, match=r"Average.update needs input 'loss'.*given: preds"):
        metrics.Average().update(metrics.Average().empty(), preds=torch.zeros(2))


def test_update_does_not_mutate_the_incoming_state() -> None:
    avg = metrics.Average()
    before = avg.empty()
    avg.update(before, loss=torch.tensor(3.0))
    assert float(before.total) == 0.0 and float(before.count) == 0.0


@pytest.mark.parametrize("top_k", [1, 3])
def test_accuracy_batchwise_with_short_last_batch_equals_torchmetrics(classification, top_k) -> None:
    logits, labels = classification
    acc = metrics.Accuracy(top_k=top_k)
    state = acc.empty()
    for rows in _batches(len(labels), 16):
        state = acc.update(state, preds=logits[rows], target=labels[rows])
    reference = torchmetrics.functional.accuracy(
        logits, labels, task="multiclass", num_classes=5, top_k=top_k, average="micro"
    )
    assert torch.allclose(acc.compute(state), reference, atol=1e-6)
    assert int(state.count) == 53


def test_accuracy_mask_and_sequence_shapes() -> None:
    acc = metrics.Accuracy()
    logits = torch.tensor([[[5.0, 0.0], [0.0, 5.0]], [[5.0, 0.0], [5.0, 0.0]]])  # (2, 2 tokens, 2 classes)
    target = torch.tensor([[0, 1], [1, 1]])
    mask = torch.tensor([[1, 1], [1, 0]])
    state = acc.update(acc.empty(), preds=logits, target=target, mask=mask)
    assert int(state.total) == 2 and int(state.count) == 3


def test_accuracy_shape_error_names_shapes() -> None:
    with pytest.raises(ValueError, match=r"preds of shape \(4, 3\) do not match target of shape \(5,\)"):
        metrics.Accuracy().update(metrics.Accuracy().empty(), preds=torch.zeros(4, 3), target=torch.zeros(5))
    with pytest.raises(ValueError, match="top_k"):
        metrics.Accuracy(top_k=0)


def test_merge_of_two_halves_equals_the_whole(classification) -> None:
    logits, labels = classification
    collection = metrics.Collection(
        {
            "accuracy": metrics.Accuracy(),
            "loss": metrics.Average(),
            "f1": metrics.from_torchmetrics("F1Score", task="multiclass", num_classes=5, average="macro"),
        }
    )

    def run(rows: list[slice]) -> dict:
        state = collection.empty()
        for r in rows:
            loss = torch.nn.functional.cross_entropy(logits[r], labels[r])
            state = collection.update(
                state, preds=logits[r], target=labels[r], loss=loss, num_examples=len(labels[r])
            )
        return state

    batches = _batches(53, 10)
    whole = collection.compute(run(batches))
    merged = collection.compute(collection.merge(run(batches[:3]), run(batches[3:])))
    assert whole.keys() == merged.keys() == {"accuracy", "loss", "f1"}
    for name in whole:
        assert torch.allclose(whole[name], merged[name], atol=1e-6), name
    full_loss = torch.nn.functional.cross_entropy(logits.double(), labels)
    assert abs(float(whole["loss"]) - float(full_loss)) < 1e-5


def test_collection_flattens_dict_results_and_checks_state_keys() -> None:
    class Pair:
        def empty(self, device=None):
            return torch.zeros((), device=device)

        def update(self, state, **inputs):
            return state + 1

        def merge(self, a, b):
            return a + b

        def reductions(self):
            return "sum"

        def compute(self, state):
            return {"a": state, "b": state * 2}

    collection = metrics.Collection({"pair": Pair()})
    out = collection.compute(collection.update(collection.empty()))
    assert set(out) == {"pair/a", "pair/b"} and float(out["pair/b"]) == 2.0
    with pytest.raises(ValueError, match=r"state keys \['other'\] do not match the metrics \['pair'\]"):
        collection.update({"other": torch.zeros(())})
    with pytest.raises(TypeError, match="metric 'bad' is a int"):
        metrics.Collection({"bad": 3})


def test_metric_from_spec_names_dicts_and_errors() -> None:
    assert metrics.metric_from_spec("accuracy") == metrics.Accuracy()
    assert metrics.metric_from_spec("Accuracy") == metrics.Accuracy()
    assert metrics.metric_from_spec({"name": "accuracy", "top_k": 5}) == metrics.Accuracy(top_k=5)
    assert metrics.metric_from_spec("loss") == metrics.Average("loss")
    tm = metrics.metric_from_spec({"name": "Accuracy", "task": "multiclass", "num_classes": 10})
    assert isinstance(tm, metrics.TorchMetric) and tm.name == "Accuracy"
    f1 = metrics.metric_from_spec({"name": "f1", "num_classes": 3, "average": "macro"})
    assert f1.arguments["task"] == "multiclass"
    with pytest.raises(ValueError, match=r"Did you mean: .*F1Score"):
        metrics.metric_from_spec("F1Scor")
    with pytest.raises(ValueError, match="no 'name' key"):
        metrics.metric_from_spec({"average": "macro"})
    with pytest.raises(ValueError, match="needs task="):
        metrics.metric_from_spec("Precision")


def test_available_metrics_all_build() -> None:
    names = metrics.available_metrics()
    assert {"accuracy", "average", "F1Score", "MeanSquaredError", "ConfusionMatrix"} <= set(names)
    for name in ("accuracy", "average", "loss"):
        assert isinstance(metrics.metric_from_spec(name), metrics.Metric), name


@pytest.mark.compile
def test_collection_update_compiles_to_one_graph_and_equals_eager(classification, recording_inductor) -> None:
    logits, labels = classification
    collection = metrics.Collection(
        {
            "loss": metrics.Average(),
            "accuracy": metrics.Accuracy(),
            "f1": metrics.from_torchmetrics("F1Score", task="multiclass", num_classes=5, average="macro"),
        }
    )
    graphs = recording_inductor.graphs

    def eval_update(state, preds, target):
        loss = torch.nn.functional.cross_entropy(preds, target)
        return collection.update(state, preds=preds, target=target, loss=loss, num_examples=preds.shape[0])

    torch._dynamo.reset()
    compiled = torch.compile(eval_update, backend=recording_inductor, fullgraph=True)
    state_c = state_e = collection.empty()
    for rows in (slice(0, 8), slice(8, 16), slice(16, 24)):  # same shapes: no recompile
        state_c = compiled(state_c, logits[rows], labels[rows])
        state_e = eval_update(state_e, logits[rows], labels[rows])
    assert len(graphs) == 1
    got, want = collection.compute(state_c), collection.compute(state_e)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6), name
