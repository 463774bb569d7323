"""What a checkpoint keeps of the training data besides its position, and how a resume uses it.

- **The key that orders the data** (the loader's): a resumed run reads the interrupted run's order, whatever
  state the new command was started from (another seed included).
- **For a stream** (:mod:`functrain.data.stream_state`), each rank's own: the stream's state at the saved
  position where it has one (``state_dict()``: torchdata's ``StatefulDataLoader``, a Hugging Face streaming
  dataset), else the fingerprint of the last batch trained on, which the resume compares with the batch the
  replayed stream gives at that position.

Under torchrun every rank reads its own stream, so the per-rank entries are gathered at each save (one
collective, for streams only: every rank saves at the same steps) and each rank takes its own on resume.
"""

from __future__ import annotations

import warnings
from typing import Any

from functrain import distributed
from functrain.checkpoint.errors import CheckpointError
from functrain.checkpoint.structure import encode
from functrain.data import DataPosition, Loader, ResumeWarning
from functrain.data.stream_state import fingerprint
from functrain.loop.data import gathered

__all__ = ["DataResume"]


class DataResume:
    """The training data's part of a run's checkpoints: :meth:`fields` to save, :meth:`restore` and
    :meth:`start` to resume.

    Example:
        >>> from functrain import random
        >>> resume = DataResume(Loader(list(range(8)), 4, key=random.key(0)))
        >>> sorted(resume.fields(DataPosition(0, 1)))  # a map-style dataset: its key is enough
        ['data_key']
    """

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.per_rank = loader.is_stream or loader.is_stateful  # what a position alone cannot resume
        self.last_batch: Any = None
        self.check = ""  # the fingerprint the replayed stream's first batch must have
        self._warned = False

    def saw(self, batch: Any) -> None:
        """Note the batch about to be trained on (a stream's: its fingerprint may be saved)."""
        if self.per_rank:
            self.last_batch = batch

    def fields(self, position: DataPosition) -> dict[str, Any]:
        """The :class:`~functrain.loop.state.LoopState` fields for a checkpoint at ``position``."""
        fields: dict[str, Any] = {"data_key": self.loader.key}
        if not self.per_rank:
            return fields
        state = self._saveable(self.loader.stream_state(position))
        last = fingerprint(self.last_batch) if state is None and self.last_batch is not None else ""
        ranks = gathered((state, last))
        fields["data_states"] = [s for s, _ in ranks]
        fields["batch_fingerprints"] = [f for _, f in ranks]
        return fields

    def restore(self, saved: dict[str, Any], position: DataPosition) -> Loader:
        """Take the saved fields (a checkpoint's ``loop``); the loader to read from (ordered by the saved
        key)."""
        key = saved.get("data_key")
        if key is not None and self.loader.key is not None:  # the interrupted run's order, not this state's
            self.loader = self.loader.with_key(key)
        states, prints = saved.get("data_states") or [], saved.get("batch_fingerprints") or []
        if not self.per_rank or not states:
            return self.loader
        rank, world = distributed.rank(), distributed.world_size()
        if len(states) != world:
            warnings.warn(
                f"fit: the checkpoint holds the training streams of {len(states)} ranks and this run has "
                f"{world}: each rank's stream is read again from the start of the epoch and the batches "
                f"trained on are skipped, unchecked. Resume on {len(states)} ranks for an exact resume",
                ResumeWarning,
                stacklevel=3,  # at fit
            )
        elif states[rank] is not None:  # a stateful stream continues from its own state
            self.loader.restore_stream(position, states[rank])
        else:
            self.check = str(prints[rank])
        return self.loader

    def start(self, position: DataPosition) -> tuple[DataPosition, str]:
        """Where to start reading from ``position``, and the fingerprint the first batch read must have
        (``""``: nothing to check). A replayed stream starts one batch early: its last batch trained on is
        read again and compared."""
        epoch, index = position.as_tuple()
        if self.check and index > 0:
            return DataPosition(epoch, index - 1), self.check
        return position, ""

    def _saveable(self, state: Any) -> Any:
        """``state`` if a checkpoint can hold it, else ``None`` and a warning (once): a resume replays."""
        if state is None:
            return None
        try:
            encode(state)
        except CheckpointError as error:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"fit: the training data's state_dict() cannot be saved in a checkpoint ({error}); the "
                    "checkpoints keep no data state, so a resume replays the data (and checks the replay) "
                    "instead of continuing it. Return tensors, numbers, strings, bytes, lists and dicts "
                    "from state_dict()",
                    ResumeWarning,
                    stacklevel=5,
                )
            return None
        return state
