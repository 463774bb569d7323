"""Tiny Hugging Face models (built from configs, no download) train in one compiled graph, compiled once, as
eager torch.optim.AdamW does. Classification heads set ``config.problem_type`` in their first forward; the
step must not recompile for it (functrain.jit runs one eager forward before the first trace)."""

from __future__ import annotations

import copy

import pytest
import torch

import functrain as ft

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, LENGTH = 100, 4, 12


def _bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config), "classify"


def _vit():
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config), "image"


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config), "lm"


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), "lm"


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config), "seq2seq"


MODELS = {"bert": _bert, "vit": _vit, "gpt2": _gpt2, "llama": _llama, "t5": _t5}


def _batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 9:] = 0  # one padded sequence
    if kind == "classify":
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.randint(0, 3, (BATCH,), generator=g),
        }
    if kind == "image":
        return {
            "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 3, (BATCH,), generator=g),
        }
    if kind == "lm":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}
    labels = torch.randint(3, VOCAB, (BATCH, 7), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_loss(model, batch):
    """Hugging Face's convention: the model computes its loss from the batch's ``labels``."""
    return model(**batch).loss


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_compiles_once_and_matches_eager_adamw(name: str):
    torch.manual_seed(0)
    model, kind = MODELS[name]()
    reference = copy.deepcopy(model)
    state = ft.TrainState.create(model, ft.optim.adamw(1e-3, weight_decay=0.01), seed=0)
    step = ft.jit(ft.make_train_step(model, hf_loss))
    for i in range(4):
        state, metrics = step(state, _batch(kind, i))
    assert step.num_compiles == 1, step.compile_reasons

    reference.train()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    for i in range(4):
        opt.zero_grad()
        loss = hf_loss(reference, _batch(kind, i))
        loss.backward()
        opt.step()
    assert torch.allclose(metrics["loss"], loss.detach(), atol=1e-4)
    expected = dict(reference.named_parameters())
    for key, value in state.params.items():
        assert torch.allclose(value, expected[key].detach(), atol=1e-4, rtol=0), key
    if kind in ("classify", "image"):  # settled before the trace, as eagerly
        assert model.config.problem_type == reference.config.problem_type == "single_label_classification"
