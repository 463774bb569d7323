"""Ragged batches at the compiled shape (functrain.data.padding): a short batch padded to the batch size
with a mask, and every number of a padded run equal to the unpadded one (issue 25, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

import functrain as ft
from functrain import metrics
from functrain.core.masked_batch import masked_loss
from functrain.data import Loader, MaskedBatch, pad_batch, trim
from functrain.data.padding import padded
from tests.trainer_fixtures import quiet_config


def _data(n: int = 101, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _collection() -> metrics.Collection:
    return metrics.Collection(
        {
            "accuracy": metrics.Accuracy(),
            "f1": metrics.from_torchmetrics("F1Score", num_classes=3, average="macro"),
            "confusion": metrics.from_torchmetrics("ConfusionMatrix", num_classes=3),
            "recall": metrics.from_torchmetrics("Recall", num_classes=3, average="weighted"),
        }
    )


def _mae_and_more(model, batch):
    """A loss function without per-example losses (the generic path) and with an extra metric."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    return loss, {"preds": logits, "target": y, "metrics": {"margin": logits.max(-1).values.mean()}}


def _unpadded(step):
    return step.replace(masked_batches=False)  # batches as they are: the reference


def _assert_same_metrics(padded_result: dict, reference: dict) -> None:
    assert padded_result.keys() == reference.keys()
    for key, value in reference.items():
        if key.startswith("eval/confusion"):
            assert padded_result[key] == value, key  # counts: exact
        else:
            assert padded_result[key] == pytest.approx(value, abs=1e-6, rel=1e-6), key


# ------------------------------------------------------------------------------------------ pad_batch


def test_pad_batch_pads_every_leaf_with_the_batch_dimension_and_trim_cuts_it_off():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 9, 1]]),
        "attention_mask": torch.ones(2, 3, dtype=torch.long),
        "labels": torch.tensor([1, 0]),
        "ids": ["a", "b"],
        "temperature": torch.tensor(0.5),
        "vocab": torch.arange(7),  # another length: not per-example
    }
    out = pad_batch(batch, 4)
    assert isinstance(out, MaskedBatch) and out.mask.tolist() == [True, True, False, False]
    assert out.batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 1], [5, 6, 7], [5, 6, 7]]
    assert out.batch["labels"].tolist() == [1, 0, 1, 1] and out.batch["ids"] == ["a", "b", "a", "a"]
    assert out.batch["temperature"] is batch["temperature"] and out.batch["vocab"] is batch["vocab"]
    back = trim(out.batch, 2, 4)
    assert all(torch.equal(back[k], batch[k]) for k in ("input_ids", "attention_mask", "labels", "vocab"))
    assert back["ids"] == ["a", "b"]
    assert pad_batch(out, 8) is out
    empty = pad_batch((torch.zeros(0, 3), torch.zeros(0)), 2)
    assert empty.batch[0].shape == (2, 3) and not empty.mask.any()
    with pytest.raises(ValueError, match="5 examples, more than the padded size 4"):
        pad_batch(torch.zeros(5), 4)


def test_padded_stream_pads_only_steps_that_take_masks():
    step = ft.make_eval_step(_model(), ft.supervised_loss(F.cross_entropy))
    batches = [(torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)), (torch.zeros(1, 6), torch.zeros(1))]
    out = list(padded(batches, step.masked_batches, None))
    assert [n for _, n in out] == [4, 1] and [b.mask.shape[0] for b, _ in out] == [4, 4]
    plain = ft.step.as_step(lambda s, b: b)  # a step of your own: its batches as they are
    assert list(padded(batches, plain.masked_batches, 4)) == [(b, None) for b in batches]
    loader = Loader(_data(5), 4, shuffle=False, prefetch=0, pad_last=True)  # padded already
    assert [n for _, n in padded(loader.epoch(0), step.masked_batches, 4)] == [4, 1]


def test_masked_loss_takes_the_padded_rows_back_out_of_a_mean_loss():
    rows = torch.tensor([1.0, 3.0, 1.0, 1.0])
    mask = torch.tensor([True, True, False, False])
    loss, _ = masked_loss(lambda b: (b.mean(), {}), rows, mask)
    assert float(loss) == pytest.approx(2.0)
    losses = lambda b: (b * 10, {})  # noqa: E731
    per, _ = masked_loss(lambda b: (b.mean(), {}), rows, mask, per_example=losses)
    assert float(per) == pytest.approx(20.0)
    nothing, _ = masked_loss(lambda b: (b.mean(), {}), rows, torch.zeros(4, dtype=torch.bool))
    assert float(nothing) == 0.0


# ------------------------------------------------------------------------------------------ metrics


@pytest.mark.parametrize(
    ("name", "kwargs", "make"),
    [
        ("F1Score", {"num_classes": 4, "average": "macro"}, "multiclass_logits"),
        ("ConfusionMatrix", {"num_classes": 4}, "multiclass_labels"),
        ("Accuracy", {"task": "binary"}, "binary_scores"),
        ("F1Score", {"task": "multilabel", "num_labels": 3}, "multilabel_logits"),
        ("MeanSquaredError", {}, "regression"),
        ("MaxMetric", {}, "values"),
    ],
)
def test_torchmetrics_with_a_mask_count_the_real_rows_only(name, kwargs, make):
    g = torch.Generator().manual_seed(1)
    rows, real = 8, 5
    preds, target = {
        "multiclass_logits": (torch.randn(rows, 4, generator=g), torch.randint(0, 4, (rows,), generator=g)),
        "multiclass_labels": (
            torch.randint(0, 4, (rows,), generator=g),
            torch.randint(0, 4, (rows,), generator=g),
        ),
        "binary_scores": (torch.randn(rows, generator=g) * 3, torch.randint(0, 2, (rows,), generator=g)),
        "multilabel_logits": (torch.randn(rows, 3, generator=g), torch.randint(0, 2, (rows, 3), generator=g)),
        "regression": (torch.randn(rows, generator=g), torch.randn(rows, generator=g)),
        "values": (torch.randn(rows, generator=g), None),
    }[make]
    metric = metrics.from_torchmetrics(name, **kwargs)
    mask = torch.arange(rows) < real
    inputs = {"value": preds} if target is None else {"preds": preds, "target": target}
    state = metric.update(metric.empty(), **inputs, mask=mask)
    reference = getattr(torchmetrics, name, None) or getattr(torchmetrics.classification, name)
    ref = reference(**{**({"task": "multiclass"} if "num_classes" in kwargs else {}), **kwargs})
    ref.update(*(v[:real] for v in inputs.values()))
    expected, got = ref.compute(), metric.compute(state)
    if expected.is_floating_point():
        assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    else:
        assert torch.equal(got, expected)


def test_accuracy_mask_per_example_broadcasts_over_tokens():
    acc = metrics.Accuracy()
    logits = torch.randn(3, 5, 4)
    labels = torch.randint(0, 4, (3, 5))
    state = acc.update(acc.empty(), preds=logits, target=labels, mask=torch.tensor([True, True, False]))
    expected = (logits[:2].argmax(-1) == labels[:2]).float().mean()
    assert int(state.count) == 10 and float(acc.compute(state)) == pytest.approx(float(expected))


# ------------------------------------------------------------------------------------------ eager loop


@pytest.mark.parametrize("loss_fn", [ft.supervised_loss(nn.CrossEntropyLoss()), _mae_and_more])
def test_evaluate_and_predict_padded_equal_the_unpadded_run(loss_fn):
    model = _model()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    data = _data(101)
    step = ft.make_eval_step(model, loss_fn, metrics=_collection())
    reference = ft.evaluate(
        state, _unpadded(ft.make_eval_step(model, loss_fn, metrics=_collection())), data, batch_size=16
    )
    _assert_same_metrics(ft.evaluate(state, step, data, batch_size=16), reference)
    preds = ft.predict(state, ft.make_predict_step(model), data, batch_size=16, collect=True)
    assert preds.shape == (101, 3)
    torch.testing.assert_close(preds, model(data.tensors[0]), atol=1e-6, rtol=1e-6)


def test_evaluate_pads_hugging_face_style_dict_batches():
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask):
            return self.head(self.embed(input_ids) * attention_mask.unsqueeze(-1))

    def loss_fn(model, batch):  # per-token loss over the real tokens (HF's ignore_index=-100)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        return loss, {"preds": logits, "target": batch["labels"]}

    torch.manual_seed(0)
    n, length = 21, 5
    lengths = torch.randint(1, length + 1, (n,))
    attention = (torch.arange(length) < lengths[:, None]).long()
    rows = [
        {"input_ids": ids, "attention_mask": m, "labels": torch.where(m.bool(), lab, -100)}
        for ids, m, lab in zip(torch.randint(0, 20, (n, length)), attention, torch.randint(0, 3, (n, length)))
    ]
    model = Tagger()
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    count = metrics.Collection({"accuracy": metrics.Accuracy()})
    got = ft.evaluate(state, ft.make_eval_step(model, loss_fn, metrics=count), rows, batch_size=8)
    ref = ft.evaluate(state, _unpadded(ft.make_eval_step(model, loss_fn, metrics=count)), rows, batch_size=8)
    assert got["eval/accuracy"] == ref["eval/accuracy"]
    # a per-token mean is not a per-example mean: the padded loss is the example-weighted batch losses
    assert got["eval/loss"] == pytest.approx(ref["eval/loss"], abs=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("loss_fn", [ft.supervised_loss(nn.CrossEntropyLoss()), _mae_and_more])
def test_training_opt_in_gives_the_params_of_unpadded_steps(loss_fn, accumulate):
    model = _model()
    data = _data(37)  # batches of 16, 16, 5
    metric = metrics.Collection({"accuracy": metrics.Accuracy()})
    step = ft.make_train_step(model, loss_fn, accumulate=accumulate, metrics=metric)
    start = ft.TrainState.create(model, ft.optim.adamw(1e-2), metrics=metric.empty())
    results = []
    for pad_last in (False, True):
        state = start
        loader = Loader(data, 16, shuffle=False, prefetch=0, pad_last=pad_last)
        for batch in loader.epoch(0):
            assert isinstance(batch, MaskedBatch) == pad_last
            state, out = step(state, batch)
        results.append((state, out))
    (plain, plain_out), (pad, pad_out) = results
    assert float(pad_out["loss"]) == pytest.approx(float(plain_out["loss"]), abs=1e-6)
    if "margin" in plain_out:
        assert float(pad_out["margin"]) == pytest.approx(float(plain_out["margin"]), abs=1e-6)
    assert torch.equal(pad.metrics["accuracy"].count, plain.metrics["accuracy"].count)
    assert torch.equal(pad.metrics["accuracy"].total, plain.metrics["accuracy"].total)
    for name in plain.params:
        torch.testing.assert_close(pad.params[name], plain.params[name], atol=1e-6, rtol=0)


def test_dropout_rows_weigh_zero_with_per_example_losses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    step = ft.make_train_step(model, ft.supervised_loss(nn.CrossEntropyLoss()))
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    x, y = _data(5).tensors
    short = pad_batch((x, y), 16)
    other = MaskedBatch(
        batch=(torch.cat([x, torch.randn(11, 6) * 100]), torch.cat([y, y[:1].repeat(11)])), mask=short.mask
    )
    torch.manual_seed(1)
    a, _ = step(state, short)
    torch.manual_seed(1)
    b, _ = step(state, other)  # other padding, same dropout masks: the same update
    for name in a.params:
        torch.testing.assert_close(a.params[name], b.params[name], atol=1e-6, rtol=0)


def test_padded_training_with_batchnorm_statistics_is_refused():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    batch = pad_batch(_data(5).tensors, 8)
    with pytest.raises(ValueError, match=r"BatchNorm in training mode.*drop_last=True, or freeze_batchnorm"):
        ft.make_train_step(model, ft.supervised_loss(F.cross_entropy))(state, batch)
    frozen = ft.make_train_step(model, ft.supervised_loss(F.cross_entropy), freeze_batchnorm=True)
    frozen(state, batch)  # running statistics only: the padded rows weigh zero


# ------------------------------------------------------------------------------------------ compiled


@pytest.mark.compile
@pytest.mark.slow
def test_trainer_fit_evaluate_predict_compile_the_eval_step_once(tmp_path: Path):
    """3 epochs with 101 validation examples at batch 16: one eval compile in the whole run, metrics as an
    eager unpadded evaluation, 101 prediction rows, and the padded training opt-in as unpadded steps."""
    model = _model()
    config = quiet_config(
        tmp_path,
        compile=True,
        epochs=3,
        shuffle=False,
        pad_train_batches=True,
        optimizer={"name": "sgd", "lr": 0.1},
        metrics={"accuracy": {}, "F1Score": {"num_classes": 3, "average": "macro"}},
        save_strategy="no",
    )
    train, val = _data(101, seed=3), _data(101)
    trainer = ft.Trainer(model, config, train, val)
    start = ft.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, trainer.state)
    result = trainer.train()
    evaluated = trainer.evaluate()
    preds = trainer.predict(val)
    assert trainer._jitted["eval"].num_compiles == 1
    assert trainer._jitted["train"].num_compiles == 1
    assert trainer._jitted["predict"].num_compiles == 1
    assert preds.shape == (101, 3)

    # the reference: eager, unpadded, the same batches in the same order
    loss_fn = ft.supervised_loss(nn.CrossEntropyLoss())
    state = start
    step = ft.make_train_step(model, loss_fn)
    for epoch in range(3):
        for batch in Loader(train, 16, shuffle=False, prefetch=0).epoch(epoch):
            state, _ = step(state, batch)
    for name in state.params:
        torch.testing.assert_close(result.state.params[name], state.params[name], atol=1e-6, rtol=0)
    eval_step = _unpadded(ft.make_eval_step(model, loss_fn, metrics=trainer.metrics))
    reference = ft.evaluate(result.state, eval_step, val, batch_size=16)
    assert evaluated.keys() == reference.keys()
    for key, value in reference.items():
        assert evaluated[key] == pytest.approx(value, abs=1e-6, rel=1e-6), key
    expected = ft.predict(result.state, ft.make_predict_step(model), val, batch_size=101, collect=True)
    torch.testing.assert_close(preds, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_padded_training_under_two_processes_equals_unpadded(tmp_path: Path):
    """Data parallelism: rank 1's share of the last batch is empty (padded: all rows masked); the
    example-weighted gradient all-reduce gives the unpadded epoch's params."""
    from tests.test_distributed_torchrun import _torchrun

    for rank in _torchrun("padded", str(tmp_path)):
        (plain, plain_loss), (padded_params, padded_loss) = rank["unpadded"], rank["padded"]
        assert float(padded_loss) == pytest.approx(float(plain_loss), abs=1e-6)
        for name in plain:
            torch.testing.assert_close(padded_params[name], plain[name], atol=1e-6, rtol=0)
