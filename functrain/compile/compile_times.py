"""How long a step's last compile took on this machine: the estimate announced before the next one.

One small JSON file in functrain's per-user cache directory (``$FUNCTRAIN_CACHE_DIR``, else
``$XDG_CACHE_HOME/functrain``, else ``~/.cache/functrain``; see :mod:`functrain.compile.isa_probe`) maps a key to
the seconds of the last first compile. The key (:func:`compile_key`) hashes what decides the graph: the
step's name, the model's class and its tensors' names, shapes and dtypes, the shapes and dtypes of the
call's tensors, the compile options and the torch version. The file keeps the newest entries only; a
missing, corrupt or unwritable file only loses the estimate.

Example:
    >>> key = compile_key("train_step", None, ((torch.zeros(2),), {}), {"mode": None})
    >>> record(key, 12.5)  # doctest: +SKIP
    >>> estimate(key)  # doctest: +SKIP
    12.5
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from functrain.compile.isa_probe import cache_root
from functrain.core.atomic import replace_text

__all__ = ["announce", "compile_key", "estimate", "record"]

log = logging.getLogger("functrain.jit")  # the logger jit's users configure

_FILE = "compile-seconds.json"
_KEEP = 256  # entries kept (the newest)


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return [list(x.shape), str(x.dtype), x.device.type]
    return type(x).__name__


def compile_key(name: str, model: Any, call: Any, options: dict[str, Any]) -> str:
    """A stable key for a step's graph: ``name``, ``model``'s class and tensors, the call's tensor
    shapes/dtypes (``call``: any pytree, e.g. ``(args, kwargs)``), ``options`` and the torch version."""
    fingerprint: dict[str, Any] = {
        "name": name,
        "torch": torch.__version__,
        "options": repr(sorted(options.items())),
        "call": [_describe(x) for x in torch_pytree.tree_leaves(call)],
    }
    if isinstance(model, torch.nn.Module):
        fingerprint["model"] = f"{type(model).__module__}.{type(model).__qualname__}"
        fingerprint["tensors"] = [[n, *_describe(t)] for n, t in model.state_dict(keep_vars=True).items()]
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read() -> dict[str, float]:
    try:
        data = json.loads((cache_root() / _FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and v >= 0}


def estimate(key: str) -> float | None:
    """Seconds of the last recorded compile under ``key``, or None."""
    return _read().get(key)


def record(key: str, seconds: float) -> None:
    """Remember ``seconds`` under ``key`` (newest last; the oldest entries beyond the limit dropped)."""
    data = _read()
    data.pop(key, None)
    data[key] = round(float(seconds), 2)
    kept = dict(list(data.items())[-_KEEP:])
    try:
        path = cache_root() / _FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps(kept))
    except OSError:  # a read-only cache: the next process has no estimate
        pass


def announce(name: str, model: Any, call: Any, options: dict[str, Any]) -> str | None:
    """Log that the first compile of ``name`` starts, with the last one's time on this machine where the
    file has it; returns the key to :func:`record` this one under (``None``: only the estimate is lost)."""
    try:
        key = compile_key(name, model, call, options)
        last = estimate(key)
    except Exception as e:  # only the estimate is lost
        log.debug("%s: no compile-time estimate (%s: %s)", name, type(e).__name__, e)
        key, last = None, None
    log.info(
        "compiling %s: first call%s", name,
        f" (~{last:.3g} s: the last compile of this step on this machine)" if last is not None else "",
    )  # fmt: skip
    return key
