"""What a run keeps across a resume (:class:`LoopState`) and what ``fit`` returns (:class:`FitResult`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from functrain import tree
from functrain.data import DataPosition
from functrain.logging import History

__all__ = ["FitResult", "LoopState", "RunFinishedWarning"]


@tree.struct
class LoopState:
    """What the loop must remember across a resume, saved beside the train state in each checkpoint.

    ``position``: where the data stream stands; ``callbacks``: each callback's ``state_dict()`` by name;
    ``history``: the logged scalars (JSON); ``window``: the running sums of the current logging window
    (JSON), so a resumed run logs the same averages; ``finished``: why the run ended for good (a final
    stop request such as early stopping), ``""`` while it may go on; ``data_key``: the key that orders the
    training data (the loader's), so a resumed run sees the interrupted run's order whatever state it was
    started from; for a stream, by rank (:mod:`functrain.loop.data_resume`): ``data_states``, its
    ``state_dict()`` at ``position`` (a torchdata ``StatefulDataLoader``, a Hugging Face streaming dataset),
    or ``None``, and then ``batch_fingerprints``, the digest of the last batch trained on, which a resume
    compares with the replayed stream's. ``tiers``: a tiered train step's decision
    (:class:`functrain.compile.tiers.TierPlan` as JSON; ``""``: none yet, or not tiered), so a resume runs
    each step on the tier the interrupted run chose.
    """

    position: DataPosition
    callbacks: dict[str, Any]
    history: str
    window: str
    finished: str = ""
    data_key: Any = None
    data_states: list[Any] | None = None
    batch_fingerprints: list[str] | None = None
    tiers: str = ""


class RunFinishedWarning(UserWarning):
    """``fit`` had nothing to do: the run already ended (its length reached, or stopped for good)."""


@dataclasses.dataclass
class FitResult:
    """What ``fit`` returns.

    Attributes:
        state: the final train state.
        history: every logged scalar (``history.series("eval/loss")``...).
        eval_metrics: the last evaluation's results, or ``None``.
        stop_reason: why the run ended early (a callback's reason, ``"preempted by SIGTERM"``...), or ``""``.
    """

    state: Any
    history: History
    eval_metrics: dict[str, float] | None = None
    stop_reason: str = ""

    @property
    def preempted(self) -> bool:
        """True when a signal ended the run (resume it with ``resume_from_checkpoint=True``)."""
        return self.stop_reason.startswith("preempted")
