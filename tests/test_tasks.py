"""Task presets: image classification and segmentation trainers, augmentations inside the step."""

from __future__ import annotations

import torch
from torch import nn

import functrain as ft
from functrain.trainer.tasks import (
    ImageClassificationTrainer,
    SegmentationTrainer,
    random_hflip,
    random_translate,
)


def images(n=32, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.1
    x[:, :, :, :4] += y.view(-1, 1, 1, 1).float()  # the class is in the left half
    return torch.utils.data.TensorDataset(x, y)


def config(tmp_path, **kw):
    fields = dict(
        output_dir=str(tmp_path / "run"),
        epochs=3,
        batch_size=8,
        compile=False,
        progress_bar=False,
        device="cpu",
        optimizer={"name": "adam", "lr": 1e-2},
    )
    return ft.TrainerConfig(**{**fields, **kw})


def test_hflip_and_translate_are_seeded_and_joint():
    x = torch.arange(16.0).reshape(1, 1, 4, 4).repeat(6, 1, 1, 1)
    mask = x[:, 0].clone()
    torch.manual_seed(1)
    a, m = random_hflip(x, mask)
    torch.manual_seed(1)
    b, _ = random_hflip(x, mask)
    assert torch.equal(a, b)
    assert torch.equal(a[:, 0], m), "image and mask flipped together"
    torch.manual_seed(0)
    every, _ = random_hflip(x, mask, p=1.0)
    assert torch.equal(every, x.flip(-1))
    assert torch.equal(
        random_translate(x, 0.0),
        torch.nn.functional.grid_sample(
            x,
            torch.nn.functional.affine_grid(
                torch.eye(2, 3).repeat(6, 1, 1), [6, 1, 4, 4], align_corners=False
            ),
            align_corners=False,
        ),
    )


def test_image_classification_trainer_learns(tmp_path):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 2))
    trainer = ImageClassificationTrainer(
        model,
        config(tmp_path, metrics={"accuracy": {}}),
        images(),
        images(16, seed=1),
        mean=(0.5,),
        std=(0.5,),
        augmentations=("translate",),
        max_shift=0.05,
    )
    trainer.train()
    assert trainer.evaluate()["eval/accuracy"] >= 0.9


def test_segmentation_trainer_pixel_accuracy_and_iou(tmp_path):
    x = images(24).tensors[0]
    masks = (x[:, 0] > 0.5).long()  # segment the bright half
    ds = torch.utils.data.TensorDataset(x, masks)
    model = nn.Conv2d(1, 2, 3, padding=1)
    cfg = config(
        tmp_path,
        epochs=5,
        metrics={
            "Accuracy": {"task": "multiclass", "num_classes": 2},
            "JaccardIndex": {"task": "multiclass", "num_classes": 2},
        },
    )
    trainer = SegmentationTrainer(model, cfg, ds, ds)
    trainer.train()
    results = trainer.evaluate()
    assert results["eval/Accuracy"] > 0.9 and results["eval/JaccardIndex"] > 0.8


def test_each_task_refuses_the_augmentations_it_does_not_support(tmp_path):
    import pytest

    seg = nn.Conv2d(1, 2, 1)
    with pytest.raises(ValueError, match=r"\['translate'\] are not supported; supported: \['hflip'\]"):
        SegmentationTrainer(seg, config(tmp_path), augmentations=("translate",))
    with pytest.raises(ValueError, match=r"\['rotate'\] are not supported"):
        ImageClassificationTrainer(seg, config(tmp_path), augmentations=("rotate",))
