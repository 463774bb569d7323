"""Checkpoints as pytrees: msgpack files (no pickle), atomic writes, bit-exact restore.

- :func:`save` / :func:`restore` / :func:`read_header`: one file, any functrain pytree;
  :func:`restore_onto`: a restored tree's plain containers back onto a target (a train state), checked.
- :class:`CheckpointManager`: a folder of checkpoints with retention (last N, every K, best K), atomic
  and optionally asynchronous saves, ``restore("latest" | "best" | step)``.
- :func:`init_weights_from`: partial restore of matching parameters, for fine-tuning.
- :func:`to_state_dict`, :func:`export`, :func:`load_state_dict`: interop with ``torch.save`` files,
  ``nn.Module.load_state_dict`` and safetensors.

Example:
    >>> import torch, tempfile
    >>> from functrain import checkpoint
    >>> with checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as manager:
    ...     for step in (1, 2, 3):
    ...         manager.save(step, {"w": torch.full((2,), float(step))}, metrics={"loss": 1.0 / step})
    ...     manager.all_steps(), manager.restore("latest")["w"]
    ([2, 3], tensor([3., 3.]))
"""

from typing import TYPE_CHECKING

from functrain.core import lazy as _lazy

# imported on first use, so `functrain inspect --help` (and `functrain --help`) load no torch
_lazy.install(
    __name__,
    {
        "CheckpointError": "functrain.checkpoint.errors",
        **dict.fromkeys(("read_header", "restore", "save"), "functrain.checkpoint.file"),
        **dict.fromkeys(("CheckpointHeader", "TensorInfo"), "functrain.checkpoint.format"),
        **dict.fromkeys(("export", "to_state_dict"), "functrain.checkpoint.interop"),
        "CheckpointManager": "functrain.checkpoint.manager",
        **dict.fromkeys(("InitReport", "init_weights_from"), "functrain.checkpoint.partial"),
        "load_state_dict": "functrain.checkpoint.sources",
        "restore_onto": "functrain.checkpoint.onto",
    },
)

if TYPE_CHECKING:
    from functrain.checkpoint.errors import CheckpointError
    from functrain.checkpoint.file import read_header, restore, save
    from functrain.checkpoint.format import CheckpointHeader, TensorInfo
    from functrain.checkpoint.interop import export, to_state_dict
    from functrain.checkpoint.manager import CheckpointManager
    from functrain.checkpoint.onto import restore_onto
    from functrain.checkpoint.partial import InitReport, init_weights_from
    from functrain.checkpoint.sources import load_state_dict

__all__ = [
    "CheckpointError",
    "CheckpointHeader",
    "CheckpointManager",
    "InitReport",
    "TensorInfo",
    "export",
    "init_weights_from",
    "load_state_dict",
    "read_header",
    "restore",
    "restore_onto",
    "save",
    "to_state_dict",
]
