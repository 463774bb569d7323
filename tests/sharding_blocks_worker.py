"""ZeRO-3 with blocks (params gathered inside each block, per-block recompute) under torchrun.

    python -m torch.distributed.run --nproc_per_node=N tests/sharding_blocks_worker.py MODE OUT_DIR

Modes: ``blocks`` (the transformer's encoder layers and a CNN's conv blocks, BatchNorm outside them,
against one process on the union batch / ZeRO-3 without blocks; gathers counted; the guards),
``blocks_compile`` (the same transformer compiled). Reuses ``sharding_worker``'s models, data and
comparison; each rank writes ``OUT_DIR/<mode>_rank<r>.pt``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import sharding_worker as w
import torch
from torch import nn
from torchrun_exit import exit_skipping_teardown

from functrain import distributed
from functrain.distributed import sharding as sharding_mod
from functrain.distributed.block_spec import block_names


class BlockCNN(nn.Module):
    """A BatchNorm stem (outside the blocks) and two repeated conv blocks in a ModuleList. No bias before
    the BatchNorm: its gradient is 0 in exact arithmetic, and Adam turns the rounding noise into steps."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.Tanh()) for _ in range(2)
        )
        self.head = nn.Linear(3 * 4 * 4, w.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.flatten(1))


def _counting_gathers() -> tuple[list[int], list[int], Any]:
    """Counts the differentiable all-gathers (one per block in the forward, one in the recompute), and
    records after each block's backward how many collectives c10d still holds unwaited (a reduce-scatter
    left pending kept its whole input alive until the optimizer read the gradient)."""
    calls, pending = [0], []
    real_forward, real_backward = sharding_mod._AllGather.forward, sharding_mod._AllGather.backward

    def counted(flat: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
        calls[0] += 1
        return real_forward(flat, group, world_size)

    def watched(ctx: Any, grad: torch.Tensor) -> Any:
        out = real_backward(ctx, grad)
        pending.append(torch._C._distributed_c10d._get_work_registry_size())
        return out

    patches = contextlib.ExitStack()
    patches.enter_context(w._patched(sharding_mod._AllGather, "forward", staticmethod(counted)))
    patches.enter_context(w._patched(sharding_mod._AllGather, "backward", staticmethod(watched)))
    return calls, pending, patches


def _initial(cls: type[nn.Module]) -> dict[str, torch.Tensor]:
    """The params before training: the trained ones must be far from them (the comparison is not of
    two states that hardly moved)."""
    return {k: p.detach() for k, p in w.build(cls, on_meta=False).named_parameters()}


def blocks(out: dict) -> None:
    world = distributed.world_size()
    out["block_names"] = block_names(w.Transformer(), "auto")
    data = w.batches("transformer")
    ref, ref_m = w.reference(w.Transformer, w.adamw, data)
    out["moved"] = w.diff(ref.params, _initial(w.Transformer))
    calls, pending, counting = _counting_gathers()
    with counting:
        state, m, _ = w.sharded_run(w.Transformer, w.adamw, data, "params", blocks="auto")
    # an eager step's first call also runs the forward under torch.func's transform once, as a check
    # (functrain/step/grad.py): one more gather of each of the 2 blocks
    out["gathers_per_step"] = (calls[0] - 2) / len(data)
    out["pending_after_block_backward"] = pending
    out["transformer"] = w.compare(state, m, ref, ref_m)
    acc_data = w.batches("transformer", (8, 7, 8, 6) if world == 2 else (8, 16, 12))
    ref_a, ref_am = w.reference(w.Transformer, w.adamw, acc_data)
    state, m, _ = w.sharded_run(w.Transformer, w.adamw, acc_data, "params", accumulate=2, blocks="auto")
    out["transformer/accumulate2"] = w.compare(state, m, ref_a, ref_am)
    # the CNN: BatchNorm normalises per rank, so the one-process run is not its reference; ZeRO-3
    # without blocks (tested against replicated data parallelism in test_sharding_torchrun) is
    cnn_data = w.batches("cnn", (8, 7, 8, 6, 8))
    plain, plain_m, _ = w.sharded_run(BlockCNN, w.adamw, cnn_data, "params")
    plain = plain.layout.full_state(plain)
    calls, _, counting = _counting_gathers()
    with counting:
        state, m, _ = w.sharded_run(BlockCNN, w.adamw, cnn_data, "params", blocks="auto")
    out["cnn_gathers_per_step"] = (calls[0] - 2) / len(cnn_data)
    out["cnn"] = w.compare(state, m, plain, plain_m)
    out["cnn_moved"] = w.diff(plain.params, _initial(BlockCNN))
    guards(out, data, ref, ref_m)


def guards(out: dict, data: list, ref: Any, ref_m: list) -> None:
    """The blocks' gradients zeroed, or left unreduced (each rank's own, times the world size): the
    parity comparison must see both."""
    real = sharding_mod._AllGather.backward

    def zeroed(ctx: Any, grad: torch.Tensor) -> Any:
        g, *_ = real(ctx, grad)
        return torch.zeros_like(g), None, None

    def unreduced(ctx: Any, grad: torch.Tensor) -> Any:
        world, rank = distributed.world_size(), distributed.rank()
        return grad.reshape(world, -1)[rank] * world, None, None

    for name, backward in (("zero_gradients", zeroed), ("unreduced_gradients", unreduced)):
        with w._patched(sharding_mod._AllGather, "backward", staticmethod(backward)):
            state, m, _ = w.sharded_run(w.Transformer, w.adamw, data, "params", blocks="auto")
        out[f"guard/{name}"] = w.compare(state, m, ref, ref_m)


def blocks_compiled(out: dict) -> None:
    data = w.batches("transformer", (7, 7, 7, 7))
    ref, ref_m = w.reference(w.Transformer, w.adamw, data)
    state, m, step = w.sharded_run(w.Transformer, w.adamw, data, "params", compile=True, blocks="auto")
    out["compiled"] = w.compare(state, m, ref, ref_m)
    out["num_compiles"] = step.num_compiles


if __name__ == "__main__":
    w.MODES.update({"blocks": blocks, "blocks_compile": blocks_compiled})
    w.main(*sys.argv[1:])
    exit_skipping_teardown()
