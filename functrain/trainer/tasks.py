"""Task presets (Kornia's task trainers): image classification and semantic segmentation.

Each is a :class:`functrain.Trainer` with a task's loss, metrics, preprocessing (normalisation) and
augmentations — pure tensor functions that run *inside* the compiled step. Their randomness comes from
torch's global generator, which :func:`functrain.jit` seeds from the state before every step, so
augmented runs are reproducible and resume exactly.

Example:
    >>> import tempfile
    >>> run_dir = tempfile.TemporaryDirectory()
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    >>> images = [(torch.rand(1, 8, 8), torch.tensor(i % 3)) for i in range(32)]
    >>> config = {"output_dir": run_dir.name, "epochs": 1, "batch_size": 8, "compile": False,
    ...           "progress_bar": False, "print_summary": False}
    >>> trainer = ImageClassificationTrainer(model, config, images[:24], images[24:],
    ...                                      mean=(0.5,), std=(0.25,), augmentations=("hflip", "translate"))
    >>> int(trainer.train().state.step)
    3
    >>> run_dir.cleanup()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from functrain.step.batch import inputs_and_target
from functrain.trainer.core import Trainer

__all__ = ["ImageClassificationTrainer", "SegmentationTrainer", "random_hflip", "random_translate"]


def random_hflip(images: torch.Tensor, *others: torch.Tensor, p: float = 0.5) -> tuple[torch.Tensor, ...]:
    """Flip each example left-right with probability ``p`` (the same flip for ``others``, e.g. masks).

    Example:
        >>> x = torch.arange(4.0).reshape(1, 1, 1, 4)
        >>> random_hflip(x, p=1.0)[0].flatten().tolist()
        [3.0, 2.0, 1.0, 0.0]
    """
    flip = torch.rand(images.shape[0], device=images.device) < p

    def apply(t: torch.Tensor) -> torch.Tensor:
        shape = (-1,) + (1,) * (t.ndim - 1)
        return torch.where(flip.view(shape), t.flip(-1), t)

    return (apply(images), *(apply(o) for o in others))


def random_translate(images: torch.Tensor, max_shift: float = 0.125) -> torch.Tensor:
    """Shift each image by a random fraction of its size (up to ``max_shift``), zero-padding the border.

    Example:
        >>> random_translate(torch.ones(2, 1, 8, 8), max_shift=0.0).sum().item()
        128.0
    """
    n = images.shape[0]
    shifts = (torch.rand(n, 2, device=images.device) * 2 - 1) * (2 * max_shift)
    theta = torch.zeros(n, 2, 3, device=images.device, dtype=images.dtype)
    theta[:, 0, 0] = 1
    theta[:, 1, 1] = 1
    theta[:, :, 2] = shifts.to(images.dtype)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


class _ImageTask(Trainer):
    supported_augmentations: tuple[str, ...] = ("hflip", "translate")

    def __init__(
        self,
        model: torch.nn.Module,
        config: Any,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augmentations: Sequence[str] = ("hflip",),
        max_shift: float = 0.125,
        **kwargs: Any,
    ) -> None:
        unsupported = sorted(set(augmentations) - set(self.supported_augmentations))
        if unsupported:
            raise ValueError(
                f"{type(self).__name__}: augmentations {unsupported} are not supported; "
                f"supported: {list(self.supported_augmentations)}"
            )
        if (mean is None) != (std is None):
            raise ValueError(f"{type(self).__name__}: give both mean and std (per channel), or neither")
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.augmentations = tuple(augmentations)
        self.max_shift = max_shift
        super().__init__(model, config, train_dataset, eval_dataset, **kwargs)
        if self.mean is not None:
            self.mean, self.std = self.mean.to(self.device), self.std.to(self.device)

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        images = images.float()
        return images if self.mean is None else (images - self.mean) / self.std


class ImageClassificationTrainer(_ImageTask):
    """Image classification: cross-entropy on ``(image[N, C, H, W], label[N])`` batches, accuracy by
    default, per-channel normalisation and ``hflip``/``translate`` augmentation inside the step.

    Example:
        >>> import tempfile
        >>> run_dir = tempfile.TemporaryDirectory()
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
        >>> images = [(torch.rand(1, 8, 8), torch.tensor(i % 3)) for i in range(32)]
        >>> trainer = ImageClassificationTrainer(model, {"output_dir": run_dir.name, "epochs": 1,
        ...     "batch_size": 8, "metrics": ["accuracy"], "compile": False, "progress_bar": False,
        ...     "print_summary": False}, images[:24], images[24:], augmentations=("translate",))
        >>> sorted(trainer.train().eval_metrics)
        ['eval/accuracy', 'eval/loss']
        >>> run_dir.cleanup()
    """

    def preprocess(self, batch: Any) -> Any:
        x, y = inputs_and_target(batch)
        return self._normalize(x), y

    def augment(self, batch: Any) -> Any:
        x, y = batch
        if "hflip" in self.augmentations:
            (x,) = random_hflip(x)
        if "translate" in self.augmentations:
            x = random_translate(x, self.max_shift)
        return x, y


class SegmentationTrainer(_ImageTask):
    """Semantic segmentation: the configured loss (per-pixel cross-entropy by default) on ``(image[N, C, H, W], mask[N, H, W])``;
    predictions reach the metrics as logits ``[N, classes, H, W]``, torchmetrics' layout: use its
    ``Accuracy`` (pixel accuracy) and ``JaccardIndex`` (mean IoU) with ``task: multiclass``. ``hflip``
    flips image and mask together.

    Example:
        >>> import tempfile
        >>> run_dir = tempfile.TemporaryDirectory()
        >>> unet = torch.nn.Conv2d(1, 3, 3, padding=1)  # logits [N, 3, H, W]
        >>> pairs = [(torch.rand(1, 8, 8), torch.randint(0, 3, (8, 8))) for _ in range(32)]
        >>> trainer = SegmentationTrainer(unet, {"output_dir": run_dir.name, "epochs": 1, "batch_size": 8,
        ...     "compile": False, "progress_bar": False, "print_summary": False, "metrics": {
        ...     "Accuracy": {"task": "multiclass", "num_classes": 3},
        ...     "JaccardIndex": {"task": "multiclass", "num_classes": 3}}}, pairs[:24], pairs[24:])
        >>> sorted(trainer.train().eval_metrics)
        ['eval/Accuracy', 'eval/JaccardIndex', 'eval/loss']
        >>> run_dir.cleanup()
    """

    supported_augmentations = ("hflip",)  # translate would have to move the masks too

    def preprocess(self, batch: Any) -> Any:
        x, y = inputs_and_target(batch)
        return self._normalize(x), y.long()

    def augment(self, batch: Any) -> Any:
        x, y = batch
        if "hflip" in self.augmentations:
            x, y = random_hflip(x, y)
        return x, y

    def compute_loss(self, model: Callable[..., Any], batch: Any) -> Any:
        x, y = batch
        logits = model(x)
        return self.criterion(logits, y), {"preds": logits, "target": y}
