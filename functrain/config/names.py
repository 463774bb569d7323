"""The names a config may use: optimizers, schedules, and what other trainers call our fields.

``OPTIMIZER_NAMES`` lists what ``functrain.optim`` builds by name; add a name here when ``functrain.optim``
gains one, so config validation and the Trainer agree. ``SCHEDULER_NAMES`` are the keys of
:data:`functrain.config.schedules.SCHEDULES`, the table the Trainer builds schedules from.

Example:
    >>> "adamw" in OPTIMIZER_NAMES and "warmup_cosine" in SCHEDULER_NAMES
    True
    >>> metric_mode("accuracy"), metric_mode("val_loss"), metric_mode("mystery")
    ('max', 'min', None)
"""

from __future__ import annotations

import re
from typing import Literal

from functrain.config.schedules import SCHEDULES

__all__ = [
    "OPTIMIZER_ALIASES",
    "OPTIMIZER_NAMES",
    "RENAMED_FIELDS",
    "SCHEDULER_ALIASES",
    "SCHEDULER_NAMES",
    "canonical_name",
    "metric_mode",
    "unsupported_name",
]

OPTIMIZER_NAMES: tuple[str, ...] = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "lion", "lamb")

# The schedule names are the keys of the one table that builds them.
SCHEDULER_NAMES: tuple[str, ...] = tuple(SCHEDULES)

# Hugging Face's names (TrainingArguments.optim, lr_scheduler_type) for what functrain builds with the same
# math at HF's defaults (betas 0.9/0.999, eps 1e-8, weight_decay 0), mapped to functrain's name. HF's
# "sgd", "adagrad", "rmsprop", "linear", "cosine", "constant" and "polynomial" are functrain's names already.
OPTIMIZER_ALIASES: dict[str, str] = dict.fromkeys(
    (
        "adamw_torch",
        "adamw_torch_fused",
        "adamw_hf",
        "adamw_torch_xla",
        "adamw_torch_npu_fused",
        "adamw_apex_fused",
    ),
    "adamw",
)
SCHEDULER_ALIASES: dict[str, str] = {"constant_with_warmup": "constant"}

# Other trainers' names for what functrain does not build: (why, what to write instead).
_UNSUPPORTED: dict[str, dict[str, tuple[str, str]]] = {
    "optimizer": {
        "adafactor": (
            "functrain.optim has no Adafactor (factored second moments)",
            "use adamw, the nearest; or lion, which keeps one moment (half of adamw's optimizer state)",
        ),
        "lion_32bit": (
            "Hugging Face's lion_32bit takes adam_beta2 (0.999 by default) where functrain's lion has b2=0.99",
            "write name: lion with args: {b2: 0.999} for Hugging Face's defaults",
        ),
    },
    "scheduler": {
        "reduce_lr_on_plateau": (
            "functrain's schedules are functions of the step, computed inside the compiled step; a plateau "
            "rule needs the evaluation metric",
            "use a schedule of the step (cosine, linear), or lower the rate from a callback with "
            "functrain.optim.set_hyperparams",
        ),
    },
}
_LOW_BIT = ("8bit", "4bit", "bnb", "paged_", "galore", "anyprecision")


def canonical_name(value: object, aliases: dict[str, str]) -> object:
    """A name as the config stores it: lower case, another trainer's alias replaced by functrain's.

    Example:
        >>> canonical_name("AdamW_Torch_Fused", OPTIMIZER_ALIASES)
        'adamw'
    """
    if not isinstance(value, str):
        return value
    lowered = value.lower()
    return aliases.get(lowered, lowered)


def unsupported_name(what: str, name: str) -> tuple[str, str] | None:
    """``(why, fix)`` for another trainer's optimizer or scheduler name that functrain does not build
    (``what``: ``"optimizer"`` or ``"scheduler"``), ``None`` for any other name.

    Example:
        >>> unsupported_name("optimizer", "adamw_bnb_8bit")[1]
        'use adamw (full-precision states)'
    """
    found = _UNSUPPORTED[what].get(name)
    if found is None and what == "optimizer" and any(part in name for part in _LOW_BIT):
        found = (
            f"{name!r} keeps low-precision or projected optimizer states (bitsandbytes, torchao, GaLore), "
            "which functrain.optim does not",
            "use adamw (full-precision states)",
        )
    return found


# Field names of the Towhee, Hezar, LiBai and Hugging Face trainers, mapped to ours: difflib cannot
# guess that "epoch_num" means "epochs", and people bring their old configs along.
RENAMED_FIELDS: dict[str, str] = {
    "epoch_num": "epochs",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "max_iter": "max_steps",
    "train_iter": "max_steps",
    "learning_rate": "optimizer.lr",
    "lr": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "optimizer.learning_rate": "optimizer.lr",
    "lr_scheduler": "scheduler.name",
    "lr_scheduler_type": "scheduler.name",
    "lr_scheduler_kwargs": "scheduler.args",
    "warmup_steps": "scheduler.warmup_steps",
    "warmup_ratio": "scheduler.warmup_ratio",
    "val_batch_size": "eval_batch_size",
    "per_device_eval_batch_size": "eval_batch_size",
    "per_device_train_batch_size": "batch_size",
    "device_str": "device",
    "use_cpu": "device",
    "dataloader_num_workers": "num_workers",
    "num_dataloader_workers": "num_workers",
    "dataloader_pin_memory": "pin_memory",
    "dataloader_drop_last": "drop_last",
    "dataloader_shuffle": "shuffle",
    "metric": "metrics",
    "freeze_bn": "freeze.batchnorm",
    "model_checkpoint": "save_strategy",
    "checkpoint_dir": "checkpoints_dir",
    "fp16": "mixed_precision",
    "bf16": "mixed_precision",
    "clip_grad_norm": "max_grad_norm",
    "grad_clip": "max_grad_norm",
    "logging_steps": "log_steps",
    "log_period": "log_steps",
    "evaluation_strategy": "eval_strategy",
    "greater_is_better": "best_model_mode",
    "transformer_layer_cls_to_wrap": "sharding_blocks",
    "fsdp_transformer_layer_cls_to_wrap": "sharding_blocks",
}

# Whole names (lower case, separators removed) whose direction is known; anything else ending in
# "loss" or "error" is minimized. A name outside both is refused rather than guessed.
_HIGHER_IS_BETTER = frozenset(
    {
        *("accuracy", "acc", "top1", "top5", "f1", "f1score", "fbeta", "fbetascore", "precision", "recall"),
        *(
            "auroc",
            "auc",
            "averageprecision",
            "map",
            "iou",
            "jaccard",
            "jaccardindex",
            "dice",
            "r2",
            "r2score",
        ),
        *("psnr", "ssim", "bleu", "bleuscore", "mcc", "matthewscorrcoef", "specificity", "cosinesimilarity"),
        "explainedvariance",
    }
)
_LOWER_IS_BETTER = frozenset(
    {"loss", "mse", "mae", "rmse", "cer", "wer", "perplexity", "ppl", "hinge", "kldivergence"}
)


def metric_mode(name: str) -> Literal["min", "max"] | None:
    """Whether a smaller (``"min"``) or larger (``"max"``) value of the metric ``name`` is better.

    Returns None when the name does not tell; the config then asks the user to say so.

    Example:
        >>> metric_mode("F1Score"), metric_mode("cer")
        ('max', 'min')
    """
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    if key in _HIGHER_IS_BETTER:
        return "max"
    if key in _LOWER_IS_BETTER or key.endswith(("loss", "error")):
        return "min"
    return None
