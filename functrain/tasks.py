"""Task presets, at their old address: :mod:`functrain.trainer.tasks`.

Example:
    >>> from functrain.tasks import ImageClassificationTrainer  # doctest: +SKIP
"""

from functrain.trainer.tasks import (
    ImageClassificationTrainer,
    SegmentationTrainer,
    random_hflip,
    random_translate,
)

__all__ = ["ImageClassificationTrainer", "SegmentationTrainer", "random_hflip", "random_translate"]
