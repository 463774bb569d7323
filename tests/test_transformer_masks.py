"""``nn.Transformer`` with causal and padding masks trains and evaluates in one compiled graph (torch's
causal-mask detection and the inference fast path read tensor values; functrain._attention_paths routes
them), compiled once, with eager's numbers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functrain as ft
from functrain._attention_paths import causal_hint, traceable_attention

VOCAB, D = 20, 16
LR = 1e-3


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.transformer = nn.Transformer(
            D, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, dropout=0.0,
            batch_first=True,
        )  # fmt: skip
        self.transformer.encoder.mask_check = False  # lets eval mode reach the nested-tensor fast path
        self.out = nn.Linear(D, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_padding: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        hidden = self.transformer(
            self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=src_padding,
            memory_key_padding_mask=src_padding,
        )  # fmt: skip
        return self.out(hidden)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    padding = torch.zeros(4, 9, dtype=torch.bool)
    padding[1, 6:] = True
    padding[3, 8:] = True
    return {
        "src": torch.randint(1, VOCAB, (4, 9), generator=g),
        "tgt": torch.randint(1, VOCAB, (4, 7), generator=g),
        "padding": padding,
        "labels": torch.randint(1, VOCAB, (4, 7), generator=g),
    }


def seq2seq_loss(model, batch):
    logits = model(batch["src"], batch["tgt"], batch["padding"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()), {"preds": logits}


def test_routing_is_scoped_to_models_with_attention_and_restored():
    import torch.backends.mha as mha
    import torch.nn.modules.transformer as transformer_module

    detect = transformer_module._detect_is_causal_mask
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    assert detect(mask, None, 5) is True  # torch's check reads the values
    with traceable_attention(nn.Linear(2, 2)):
        assert transformer_module._detect_is_causal_mask is detect
    with traceable_attention(Seq2Seq()):
        assert transformer_module._detect_is_causal_mask is causal_hint and not mha.get_fastpath_enabled()
        assert causal_hint(mask, None, 5) is False and causal_hint(mask, True, 5) is True
    assert transformer_module._detect_is_causal_mask is detect and mha.get_fastpath_enabled()


@pytest.mark.compile
@pytest.mark.slow
def test_nn_transformer_with_masks_compiles_once_and_matches_eager_adamw():
    torch.manual_seed(0)
    model = Seq2Seq()
    reference = copy.deepcopy(model)
    state = ft.TrainState.create(model, ft.optim.adamw(LR, weight_decay=0.01), seed=0)
    step = ft.jit(ft.make_train_step(model, seq2seq_loss))
    for i in range(4):
        state, metrics = step(state, _batch(i))
    assert step.num_compiles == 1, step.compile_reasons

    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    for i in range(4):
        opt.zero_grad()
        loss, _ = seq2seq_loss(reference, _batch(i))
        loss.backward()
        opt.step()
    assert torch.allclose(metrics["loss"], loss.detach(), atol=1e-5)
    for key, expected in reference.named_parameters():
        got, expected = state.params[key], expected.detach()
        if key.endswith("in_proj_bias"):
            # The key projection's bias shifts every score of a query alike: softmax cancels it, its
            # gradient is 0 up to float noise (~1e-9), which Adam scales to steps of up to LR either way.
            keys = slice(D, 2 * D)
            assert (got[keys] - expected[keys]).abs().max() <= 4 * LR * 1.001, key
            got, expected = torch.cat([got[:D], got[2 * D :]]), torch.cat([expected[:D], expected[2 * D :]])
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (key, (got - expected).abs().max())

    # Eval mode without gradients is where torch takes its fast path (nested tensors): compiled, the
    # reference path, with eager's numbers.
    eval_step = ft.jit(ft.make_eval_step(model, seq2seq_loss))
    model.load_state_dict(state.state_dict())
    model.eval()
    for i in (7, 8):
        compiled = eval_step(state, _batch(i))["loss"]
        with torch.no_grad():
            eager, _ = seq2seq_loss(model, _batch(i))
        assert torch.allclose(compiled, eager, atol=1e-5), (compiled, eager)
    assert eval_step.num_compiles == 1, eval_step.compile_reasons
