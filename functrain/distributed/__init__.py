"""Data-parallel training with ``torchrun``: one process per device, gradients all-reduced inside the step.

A script that runs with ``python train.py`` runs unchanged with ``torchrun --nproc_per_node=N train.py``:

.. code-block:: python

    import torch, functrain as ft
    from functrain import distributed

    with distributed.initialize() as env:              # RANK/WORLD_SIZE/LOCAL_RANK; nccl or gloo
        state = ft.TrainState.create(model, ft.optim.adamw(1e-3), seed=0)
        state = distributed.replicate(state, device=env.device)   # rank 0's weights everywhere
        reducer = distributed.gradient_reducer(model=model)       # after initialize()
        train_step = ft.jit(ft.make_train_step(model, loss_fn, gradient_reducer=reducer))
        eval_step = ft.jit(ft.make_eval_step(model, loss_fn, metrics=metrics))
        result = ft.fit(state, train_step, train_set, batch_size=32, epochs=3,   # per-rank batch size
                        eval_step=eval_step, eval_data=val_set,
                        checkpoints="ckpt", resume_from_checkpoint=True)

What each piece guarantees:

- **Gradients**: :func:`gradient_reducer` sums ``grad * n_examples`` over ranks and divides by the total
  examples, in one functional all-reduce traced into the compiled step. The update equals one process
  training on the union of the ranks' batches (an uneven or empty last batch included); the reported
  loss is the global example-weighted mean.
- **Randomness**: :func:`functrain.jit` folds the rank into each step's seed, so dropout masks differ
  per rank; the data order comes from the state's key, identical on every rank; :func:`replicate`
  makes the initial state identical whatever each rank's seed.
- **Data**: ``fit``/``evaluate`` shard a dataset over the ranks (``batch_size`` is per rank): each rank
  reads its slice of the same per-epoch permutation, all ranks take the same number of steps, the
  remainder is spread (a rank's last batch can be empty), nothing is dropped or repeated.
- **Evaluation**: the loss sum, example count and metric states are all-reduced (by each leaf's
  ``reductions()``), so metrics are exactly those over the whole set.
- **Checkpoints and logs**: only rank 0 writes (``CheckpointManager`` and ``fit``'s loggers); every rank
  restores from the shared directory.
- **Resume and world size**: the saved data position counts *global* steps (each step consumes
  ``batch_size * world_size`` examples). Resuming with another world size continues from the same
  global example exactly when the global batch ``batch_size * world_size`` is unchanged (e.g. 2 ranks
  of 16 -> 1 rank of 32); with another global batch ``fit`` refuses the checkpoint (:class:`LayoutMismatchError`).

- **Sharding (ZeRO-1/2/3)**: :func:`fully_shard` passed to ``TrainState.create(..., sharding=)`` and
  ``make_train_step(..., sharding=)`` keeps 1/world of every param and optimizer moment per rank (see
  :mod:`functrain.distributed.sharding` and ``DESIGN_FSDP.md``); sharded checkpoints:
  :mod:`functrain.checkpoint.sharded`.
- **Tensor parallelism**: :func:`tensor_parallel` (a plan of colwise / rowwise layers, params as DTensors;
  :mod:`functrain.distributed.tensor_parallel`), loaded on first use (DTensor's imports take seconds).
"""

from functrain.core import lazy as _lazy
from functrain.distributed.env import (
    DistributedEnv,
    DistributedSetupError,
    barrier,
    initialize,
    is_distributed,
    is_main_process,
    local_rank,
    rank,
    world_size,
)
from functrain.distributed.evaluation import merge_evaluation
from functrain.distributed.gradients import GradientReducer, gradient_reducer
from functrain.distributed.layout import LayoutMismatchError, check_resume, layout, loader_layout
from functrain.distributed.reduce import all_reduce_metric_state, all_reduce_tree
from functrain.distributed.replicate import NotReplicatedError, assert_replicated, replicate
from functrain.distributed.sharding import Sharding, ShardLayout, fully_shard

# DTensor's imports take seconds: the tensor-parallel names load on first use
_LAZY = {
    name: "functrain.distributed.tensor_parallel"
    for name in ("GPT_PLAN", "GPT2_PLAN", "LLAMA_PLAN", "TensorParallel", "tensor_parallel")
}
_lazy.install(__name__, _LAZY)

__all__ = [
    "GPT2_PLAN",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "DistributedEnv",
    "DistributedSetupError",
    "GradientReducer",
    "LayoutMismatchError",
    "NotReplicatedError",
    "ShardLayout",
    "Sharding",
    "TensorParallel",
    "all_reduce_metric_state",
    "all_reduce_tree",
    "assert_replicated",
    "barrier",
    "check_resume",
    "fully_shard",
    "gradient_reducer",
    "initialize",
    "is_distributed",
    "is_main_process",
    "layout",
    "loader_layout",
    "local_rank",
    "merge_evaluation",
    "rank",
    "replicate",
    "tensor_parallel",
    "world_size",
]
