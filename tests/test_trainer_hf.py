"""The Trainer takes Hugging Face models as they are (issue 25, item 4), and one name per concept:
``Trainer(loss_fn=)`` like the rest of functrain, ``criterion=`` for ``criterion(preds, target)``,
``fit(progress_bar=)`` like ``TrainerConfig.progress_bar`` (issue 21, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_fixtures import SmallNet, make_dataset, quiet_config

import functrain as ft


def token_dataset(n: int, seed: int = 0, length: int = 8, vocab: int = 30) -> list[dict[str, torch.Tensor]]:
    """Dict examples as a Hugging Face tokenizer and datasets give them; the label is the first token mod 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[n // 2 :, -2:] = 0  # some padding
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i, 0] % 3} for i in range(n)]


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def reference_eval(model: torch.nn.Module, data: list[dict], batch_size: int) -> tuple[float, float]:
    """HF's own loss (example-weighted over batches) and the accuracy of its logits, in plain torch."""
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            batch = ft.data.collate(data[start : start + batch_size])
            out = model(**batch)
            loss_sum += float(out.loss) * len(batch["labels"])
            correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
    return loss_sum / len(data), correct / len(data)


def test_trainer_trains_evaluates_and_predicts_a_hf_model_as_it_is(tmp_path: Path):
    model = tiny_bert()
    train, val = token_dataset(96), token_dataset(40, seed=1)
    config = quiet_config(
        tmp_path, epochs=3, batch_size=16, metrics=["accuracy"], optimizer={"name": "adamw", "lr": 3e-3}
    )
    trainer = ft.Trainer(model, config, train_dataset=train, eval_dataset=val)  # no subclass, no loss

    before = trainer.evaluate()
    ref_loss, ref_acc = reference_eval(model, val, 16)  # the model's weights are the state's before training
    assert before["eval/loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert before["eval/accuracy"] == pytest.approx(ref_acc, abs=1e-6)

    result = trainer.train()
    assert int(result.state.step) == 3 * 6
    assert result.history.series("train/loss")
    after = trainer.evaluate()
    assert after["eval/loss"] < before["eval/loss"]

    logits = trainer.predict(val)
    assert logits.shape == (40, 3)
    labels = torch.stack([ex["labels"] for ex in val])
    assert after["eval/accuracy"] == pytest.approx(
        float((logits.argmax(-1) == labels).float().mean()), abs=1e-6
    )
    # the trained weights, put back into the model, give HF's own numbers
    model.load_state_dict(trainer.state.state_dict())
    ref_loss, ref_acc = reference_eval(model, val, 16)
    assert after["eval/loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert after["eval/accuracy"] == pytest.approx(ref_acc, abs=1e-6)


def test_a_hf_model_with_an_explicit_criterion_uses_it_on_the_logits(tmp_path: Path):
    model = tiny_bert()
    val = token_dataset(32, seed=1)
    config = quiet_config(tmp_path, epochs=1, eval_strategy="no")
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.2)
    trainer = ft.Trainer(model, config, token_dataset(32), criterion=smoothed)
    model.eval()
    with torch.no_grad():
        batch = ft.data.collate(val)
        expected = float(smoothed(model(**batch).logits, batch["labels"]))
    assert trainer.evaluate(ft.data.Loader(val, 32, shuffle=False))["eval/loss"] == pytest.approx(
        expected, rel=1e-5
    )


def test_loss_fn_is_a_trainer_parameter_as_the_key_error_hint_says(tmp_path: Path):
    def examples(n):
        x, y = make_dataset(n).tensors
        return [{"features_a": x[i], "cls": y[i]} for i in range(n)]  # keys the Trainer cannot guess

    config = quiet_config(tmp_path, epochs=1, eval_strategy="no")
    with pytest.raises(KeyError, match=r"loss_fn\(model, batch\)"):
        ft.Trainer(SmallNet(), config, examples(32)).train()

    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        logits = model(batch["features_a"])
        return torch.nn.functional.cross_entropy(logits, batch["cls"]), {
            "preds": logits,
            "target": batch["cls"],
        }

    config = quiet_config(tmp_path, output_dir=str(tmp_path / "b"), epochs=1, eval_strategy="no")
    result = ft.Trainer(SmallNet(), config, examples(32), loss_fn=loss_fn).train()
    assert int(result.state.step) == 2 and calls


def test_trainer_criterion_is_kept_and_excludes_loss_fn(tmp_path: Path):
    config = quiet_config(tmp_path, epochs=1, eval_strategy="no")
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    assert ft.Trainer(SmallNet(), config, make_dataset(32), criterion=criterion).criterion is criterion
    with pytest.raises(TypeError, match="not both"):
        ft.Trainer(SmallNet(), config, make_dataset(32), criterion=criterion, loss_fn=lambda m, b: 0)
