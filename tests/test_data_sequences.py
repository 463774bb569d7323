"""functrain.data.sequences: a batch's sequence axis padded to a bucket length, masked, so variable-length
sequences compile a bounded few shapes; the padded batch gives the model the unpadded batch's loss."""

from __future__ import annotations

import pickle

import pytest
import torch
from test_trainer_hf import tiny_bert

import functrain as ft
from functrain.data import SequencePadding, bucket_length, pad_sequences


def test_bucket_lengths_double_from_the_multiple():
    assert [bucket_length(n, 8) for n in (1, 8, 9, 16, 17, 100, 512)] == [8, 8, 16, 16, 32, 128, 512]
    # at most log2(longest / multiple) + 1 shapes, never more than twice the longest sequence
    lengths = range(1, 513)
    assert len({bucket_length(n, 16) for n in lengths}) == 6
    assert all(n <= bucket_length(n, 16) < max(2 * n, 16) + 1 for n in lengths)
    with pytest.raises(ValueError, match="multiple"):
        bucket_length(3, 0)


def _hf_batch() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
        "token_type_ids": torch.zeros(2, 5, dtype=torch.long),
        "labels": torch.tensor([[1, 2, 0, 1, 2], [2, 1, -100, -100, -100]]),  # per token
        "inputs_embeds": torch.ones(2, 5, 3),
        "score": torch.tensor([0.5, 1.5]),
    }


def test_every_sequence_tensor_is_padded_masked_and_ignored():
    out = pad_sequences(_hf_batch(), 8, pad_token_id=1)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "input_ids": (2, 8),
        "attention_mask": (2, 8),
        "token_type_ids": (2, 8),
        "labels": (2, 8),
        "inputs_embeds": (2, 8, 3),
        "score": (2,),
    }
    assert out["input_ids"][:, 5:].eq(1).all() and out["attention_mask"][:, 5:].eq(0).all()
    assert out["labels"][:, 5:].eq(-100).all() and out["inputs_embeds"][:, 5:].eq(0).all()
    assert torch.equal(out["input_ids"][:, :5], _hf_batch()["input_ids"])
    assert pad_sequences(_hf_batch(), length=12)["input_ids"].shape == (2, 12)
    assert pad_sequences(_hf_batch(), length=3)["input_ids"].shape == (2, 5)  # never cut


def test_batches_without_an_attention_mask_pass_unchanged():
    plain = (torch.zeros(2, 5), torch.zeros(2))
    assert pad_sequences(plain, 8) is plain
    ids_only = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}  # no mask: padding would be seen
    assert pad_sequences(ids_only, 8) is ids_only
    with pytest.raises(ValueError, match=r"multiple= .* or length="):
        pad_sequences(_hf_batch())


def test_the_padded_batch_gives_the_model_the_unpadded_loss_and_gradient():
    model = tiny_bert().eval()
    batch = {k: _hf_batch()[k] for k in ("input_ids", "attention_mask")}
    batch["labels"] = torch.tensor([1, 2])
    padded = pad_sequences(batch, 16)
    assert padded["input_ids"].shape == (2, 16)
    losses, grads = [], []
    for b in (batch, padded):
        model.zero_grad()
        loss = model(**b).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.bert.embeddings.word_embeddings.weight.grad.clone())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_the_loader_collate_pads_and_pickles_for_worker_processes():
    samples = [{"input_ids": torch.arange(1, n + 1), "labels": torch.tensor(0)} for n in (3, 9, 4, 2)]
    batch = ft.data.pad_to_longest(samples[:2], pad_token_id=7)
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 7, 7, 7, 7, 7, 7] and batch["labels"].shape == (2,)
    assert batch["attention_mask"].sum(1).tolist() == [3, 9]

    loader = ft.data.Loader(
        samples, 2, shuffle=False, prefetch=0, collate_fn=SequencePadding(ft.data.pad_to_longest, 4)
    )
    assert [b["input_ids"].shape[1] for b in loader.epoch(0)] == [16, 4]
    restored = pickle.loads(pickle.dumps(SequencePadding(ft.data.collate, 4, 7)))
    assert (restored.multiple, restored.pad_token_id) == (4, 7)
