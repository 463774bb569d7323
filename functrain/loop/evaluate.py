"""``evaluate`` and ``predict``: a step over a whole data set, beside ``fit``.

Example:
    >>> import torch, functrain as ft
    >>> model = torch.nn.Linear(4, 3)
    >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
    >>> loss_fn = ft.supervised_loss(torch.nn.functional.cross_entropy)
    >>> data = [(torch.randn(4), torch.tensor(i % 3)) for i in range(10)]
    >>> eval_step = ft.jit(ft.make_eval_step(model, loss_fn), compile=False)
    >>> metrics = ft.evaluate(state, eval_step, data, batch_size=4)
    >>> inputs = [x for x, _ in data]
    >>> outputs = ft.predict(state, ft.make_predict_step(model), inputs, batch_size=4, collect=True)
    >>> sorted(metrics), outputs.shape  # 10 rows: the short last batch's padding is dropped
    (['eval/loss'], torch.Size([10, 3]))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from functrain import distributed, random, tree
from functrain.callbacks.base import Callback, Context
from functrain.data import padding
from functrain.distributed.data_ranks import data_ranks, plain_outputs
from functrain.loop.data import as_loader, batch_device, scalar_dict
from functrain.loop.events import Events
from functrain.step import as_step

__all__ = ["evaluate", "predict"]


def evaluate(
    state: Any,
    eval_step: Callable[[Any, Any], Mapping[str, Any]],
    data: Any,
    *,
    batch_size: int | None = None,
    callbacks: Sequence[Callback] = (),
    ctx: Context | None = None,
    prefix: str = "eval",
) -> dict[str, float]:
    """Run ``eval_step`` over ``data`` and return example-weighted metrics over the whole set.

    Under tensor parallelism each tp group evaluates its slice of the data (the group's ranks together)
    and its first rank counts it. The loss is weighted by each batch's example count (a short last batch counts for what it holds);
    metric states are merged across batches and computed once, so accuracy, F1 and the rest equal the
    metric over the whole set. One host sync at the end. A short last batch is padded to the batch size
    with a mask of its real rows (:mod:`functrain.data.padding`): the step compiles once.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> eval_step = ft.make_eval_step(model, ft.supervised_loss(torch.nn.functional.cross_entropy))
        >>> x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
        >>> metrics = ft.evaluate(state, eval_step, list(zip(x, y)), batch_size=4)  # batches of 4, 4, 2
        >>> whole = torch.nn.functional.cross_entropy(model(x), y)  # the loss over the whole set at once
        >>> sorted(metrics), abs(metrics["eval/loss"] - whole.item()) < 1e-6
        (['eval/loss'], True)
    """
    ranks = data_ranks(state)  # tensor parallelism: a slice per tp group, counted by its first rank
    loader = as_loader(
        data, batch_size, random.key(0), "evaluate", shuffle=False, shard=True,
        ranks=(ranks.rank, ranks.world_size), device=batch_device(state),
    )  # fmt: skip
    events = Events(callbacks)
    ctx = ctx or Context()
    ctx.phase = "eval"
    spec = as_step(eval_step)
    sums = _Sums(spec.metrics)
    for batch, real in padding.padded(loader.epoch(0), spec.masked_batches, loader.batch_size):
        ctx.batch = batch
        state = events("eval_batch_begin", state, ctx)
        out = plain_outputs(eval_step(state, batch), ranks)
        n = int(out["num_examples"]) if real is None else real
        if n == 0:
            continue  # an empty shard of a distributed last batch
        if ranks.counts:  # a tp group's other ranks computed the same sums
            sums.add(out, n)
        state = events("eval_batch_end", state, ctx)
    ctx.batch = None
    ctx.phase = "train"
    return sums.compute(spec.naming(state), prefix, state.device)


@dataclasses.dataclass
class _Sums:
    """An evaluation's example-weighted running sums: the loss, the step's other tensors (``extras``) and
    the merged metric states; :meth:`compute` merges them across ranks (once) and divides."""

    metric_fns: Any
    loss: torch.Tensor | None = None
    count: int = 0
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    merged: Any = None

    def add(self, out: Mapping[str, Any], n: int) -> None:
        """Add one batch's step output, which holds ``n`` real examples."""
        weighted = out["loss"] * n
        self.loss = weighted if self.loss is None else self.loss + weighted
        self.count += n
        for k, v in out.items():
            if k not in ("loss", "num_examples", "metrics", "preds") and isinstance(v, torch.Tensor):
                self.extras[k] = self.extras.get(k, 0) + v * n
        if out.get("metrics") is not None and self.metric_fns is not None:
            metrics = out["metrics"]
            self.merged = metrics if self.merged is None else self.metric_fns.merge(self.merged, metrics)

    def compute(self, naming: Any, prefix: str, device: torch.device) -> dict[str, float]:
        """The metrics over every rank's examples, as floats (one host sync)."""
        loss_sum, count, extra_sums, merged = distributed.merge_evaluation(
            self.loss, self.count, self.extras, self.merged, self.metric_fns, device
        )
        if count == 0:
            raise ValueError("evaluate: the evaluation data produced no examples")
        values: dict[str, Any] = {f"{prefix}/loss": loss_sum / count}
        values.update({f"{prefix}/{k}": v / count for k, v in extra_sums.items()})
        if merged is not None:
            values.update(naming.flatten(prefix, self.metric_fns.compute(merged)))
        return scalar_dict(naming.expand(values))


def predict(
    state: Any,
    predict_step: Callable[[Any, Any], Any],
    data: Any,
    *,
    batch_size: int | None = None,
    collect: bool = False,
) -> Iterator[Any] | Any:
    """Stream ``predict_step`` outputs batch by batch (``collect=True``: concatenate them all).

    A short last batch runs padded to the batch size (one compile); its outputs keep the real rows only.

    Example:
        >>> import functrain as ft
        >>> model = torch.nn.Linear(4, 3)
        >>> state = ft.TrainState.create(model, ft.optim.sgd(0.1))
        >>> inputs = list(torch.randn(10, 4))
        >>> outputs = ft.predict(state, ft.make_predict_step(model), inputs, batch_size=4, collect=True)
        >>> outputs.shape, torch.allclose(outputs, model(torch.stack(inputs)))
        (torch.Size([10, 3]), True)
    """
    loader = as_loader(data, batch_size, random.key(0), "predict", shuffle=False, device=batch_device(state))

    masked = as_step(predict_step).masked_batches
    ranks = data_ranks(state)  # tensor parallelism: the outputs as whole plain tensors

    def stream() -> Iterator[Any]:
        for batch, real in padding.padded(loader.epoch(0), masked, loader.batch_size):
            yield padding.unpad(plain_outputs(predict_step(state, batch), ranks), batch, real)

    if not collect:
        return stream()
    outputs = list(stream())
    if not outputs:
        return outputs
    return tree.map(lambda *xs: torch.cat(xs) if isinstance(xs[0], torch.Tensor) else list(xs), *outputs)
