"""A Hugging Face model in the Trainer, as it is: no subclass, no loss function, no wrapper.

python examples/07_hf_finetune.py

A batch dict with ``labels`` given to a model whose ``forward`` takes ``labels`` is run as
``model(**batch)``: the Trainer trains on the output's ``loss`` (Hugging Face's convention), and the
metrics see the output's ``logits`` and the batch's ``labels``. The model here is a tiny BERT built from
its config (nothing is downloaded) on a synthetic task: does a sequence contain token 7 more often than
token 8? About a minute on a laptop CPU (eager); on a GPU the steps are compiled.

For a pretrained model use ``AutoModelForSequenceClassification.from_pretrained(name)`` and a tokenizer's
``input_ids``/``attention_mask`` instead; the Trainer part stays the same.

Prints the model summary, a progress bar, the validation accuracy before and after training and four
predictions against their labels. Writes runs/hf_finetune under the folder you run it from (replaced on
each run). Needs transformers (in the ``examples`` extra: ``pip install -e ".[examples]"``).
"""

import os

import torch

import functrain as ft

try:
    import transformers
except ImportError:
    raise SystemExit(
        '07 needs transformers: pip install -e ".[examples]" (or pip install transformers)'
    ) from None

SMALL = os.environ.get("FUNCTRAIN_SMALL") == "1"
GPU = torch.cuda.is_available()
VOCAB, LENGTH = 32, 16


def examples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """What a tokenizer and ``datasets`` give: input_ids, attention_mask (some padding) and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    ids = ids * mask  # 0 is the padding token
    labels = ((ids == 7).sum(1) > (ids == 8).sum(1)).long()
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


config = transformers.BertConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=LENGTH,
    num_labels=2,
)
torch.manual_seed(0)
model = transformers.BertForSequenceClassification(config)
train, val = examples(256 if SMALL else 2048, seed=0), examples(128 if SMALL else 512, seed=1)

trainer = ft.Trainer(
    model,
    ft.TrainerConfig(
        output_dir=os.environ.get("FUNCTRAIN_OUT", "runs/hf_finetune"),
        overwrite_output_dir=True,
        epochs=1 if SMALL else 6,
        batch_size=32,
        optimizer={"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
        scheduler={"name": "warmup_cosine", "warmup_ratio": 0.1},
        metrics=["accuracy"],
        metric_for_best_model="accuracy",
        compile=GPU,  # eager on a CPU: compiling BERT there takes longer than this whole run
        progress_bar=not SMALL,
        print_summary=not SMALL,
    ),
    train_dataset=train,
    eval_dataset=val,
)
print("07: a Hugging Face BertForSequenceClassification in ft.Trainer, trained on its own outputs.loss")
before = trainer.evaluate()
trainer.train()
after = trainer.evaluate()
print(f"accuracy {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}")
logits = trainer.predict(val[:4])  # the model's logits, one row per example
print("predicted:", logits.argmax(-1).tolist(), "labels:", [int(ex["labels"]) for ex in val[:4]])
