"""How long a run trains: ``epochs``/``max_steps`` (the whole run, from step 0) or
``additional_epochs``/``additional_steps`` (more, from where the state stands), said in one object.

Example:
    >>> length = RunLength(epochs=3)
    >>> length.resolve(batches_per_epoch=10, step=0, position=DataPosition())
    (3, 30)
    >>> RunLength(additional_steps=5).resolve(batches_per_epoch=10, step=12, position=DataPosition(1, 2))
    (None, 17)
"""

from __future__ import annotations

import dataclasses

from functrain.data import DataPosition

__all__ = ["RunLength"]


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"fit: {name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunLength:
    """One of ``epochs``/``max_steps`` (both: whichever ends first) or one of ``additional_epochs``/
    ``additional_steps``; checked when made."""

    epochs: int | None = None
    max_steps: int | None = None
    additional_epochs: int | None = None
    additional_steps: int | None = None

    def __post_init__(self) -> None:
        if not self.extending and self.epochs is None and self.max_steps is None:
            raise ValueError("fit: give epochs=... or max_steps=... (how long to train)")
        if self.extending and (
            self.epochs is not None
            or self.max_steps is not None
            or None not in (self.additional_epochs, self.additional_steps)
        ):
            raise ValueError(
                "fit: give one of epochs/max_steps (the run's total length) or one of additional_epochs/"
                "additional_steps (more, from where the state stands), not several"
            )
        for field in dataclasses.fields(self):
            _positive(field.name, getattr(self, field.name))

    @property
    def extending(self) -> bool:
        """Counted from where the state stands (``additional_*``), not from step 0."""
        return self.additional_epochs is not None or self.additional_steps is not None

    @property
    def counts_epochs(self) -> bool:
        """Needs the data's epoch length (``epochs`` or ``additional_epochs``)."""
        return self.epochs is not None or self.additional_epochs is not None

    def resolve(
        self, batches_per_epoch: int | None, step: int, position: DataPosition
    ) -> tuple[int | None, int]:
        """``(epochs to iterate up to, total optimizer steps)`` of this call, counted from step 0."""
        bpe = batches_per_epoch
        if self.additional_steps is not None:
            return None, step + self.additional_steps
        if self.additional_epochs is not None:
            assert bpe is not None
            num_epochs = position.normalized(bpe).as_tuple()[0] + self.additional_epochs
            return num_epochs, num_epochs * bpe
        if self.epochs is None:
            assert self.max_steps is not None
            return None, self.max_steps
        assert bpe is not None
        total = self.epochs * bpe
        return self.epochs, total if self.max_steps is None else min(self.max_steps, total)

    def nothing_to_do(self, finished: str, step: int, total: int, batches_per_epoch: int | None) -> str:
        """Why this call has nothing to train (the warning's text), or ``""``."""
        if finished and not self.extending:
            why = f"the run was stopped for good at step {step}: {finished}"
        elif step >= total:
            given = (("epochs", self.epochs), ("max_steps", self.max_steps))
            length = " and ".join(f"{k}={v}" for k, v in given if v)
            why = (
                f"the state is at step {step}, and {length or 'this length'} ends the run at step {total} "
                "(epochs and max_steps count the whole run from step 0, so that the same call resumes a run)"
            )
        else:
            return ""
        more = ""
        if not finished:
            bpe = batches_per_epoch
            more = f"epochs={step // bpe + 1}, " if self.epochs and bpe else f"max_steps={step}+N, "
        return (
            f"fit: nothing to do, returning the state as it is: {why}. To train more, pass "
            f"{more}additional_epochs=N or additional_steps=N (Trainer.train takes the same; the CLI: "
            "functrain train ... --additional-epochs N)"
        )
