"""How the ``functrain`` command reports an error: one line on stderr and an exit status, no traceback.

- 2: a user error: the config (:class:`~functrain.config.ConfigError`), a checkpoint
  (``CheckpointError``), a missing file, a bad override, or an exception raised while building the
  user's objects (their model or dataset code: the line names the user's own frame, ``file:line``);
- 1: anything else that failed while the command ran (the line names the innermost frame outside
  functrain and torch where there is one);
- 130: interrupted (Ctrl-C) outside training.

``--debug`` (any sub-command) or ``FUNCTRAIN_DEBUG=1`` prints the full traceback as well.

Example:
    >>> one_line(ValueError("bad\\nthing"))
    'bad thing'
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from pathlib import Path

from functrain.checkpoint.errors import CheckpointError

__all__ = ["DEBUG_ENV", "BuildError", "debug_requested", "one_line", "report", "user_frame"]

DEBUG_ENV = "FUNCTRAIN_DEBUG"
# functrain's own files (the package, not only functrain/cli: a config error raised in functrain/config
# named config/section.py as the user's line), the standard library's and installed packages' (a
# Hugging Face model's code is not the user's line); a folder ends with a separator,
# so that a user's project named functrain_tasks/ is not taken for functrain/.
_FUNCTRAIN = os.path.realpath(Path(__file__).parent.parent)
_NOT_USER = tuple(
    os.path.join(os.path.realpath(p), "")
    for p in {
        _FUNCTRAIN,
        *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
    if p
)
# What torch.compile's dynamo appends to an exception raised in code it traces (the traced stack, a hint):
# the message is the part before it; the user's line is the traced stack's innermost frame.
_DYNAMO_APPENDIX = ("\nfrom user code:", "\nSet TORCHDYNAMO_VERBOSE=1")


class BuildError(Exception):
    """Building the run's objects (the user's model or datasets, the Trainer around them) failed; the
    original exception is the cause, whose innermost frame in the user's code the CLI names."""


# Errors whose message says what is wrong without their type's name.
_SELF_DESCRIBING = (CheckpointError, BuildError, FileNotFoundError, FileExistsError)


def debug_requested(flag: bool = False) -> bool:
    """``--debug`` given, or ``FUNCTRAIN_DEBUG`` set to anything but empty/``0``."""
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(error: BaseException) -> str:
    """The error's message on one line: a ``ConfigError``'s problems joined with ``"; "``, and any notes
    (``add_note``: the example, epoch and step of a data error) after the message.

    Example:
        >>> err = OSError("cannot read image 17")
        >>> err.add_note("while loading example 17 (epoch 0, step 3)")
        >>> one_line(err)
        'cannot read image 17 (while loading example 17 (epoch 0, step 3))'
    """
    problems = getattr(error, "problems", None)
    if problems:
        text = "; ".join(str(p) for p in problems)
        source = getattr(error, "source", None)  # the config file, when the error was read from one
        if len(problems) > 1:
            text = f"{len(problems)} problems in the config{f' {source}' if source else ''}: {text}"
        elif source:
            text = f"{source}: {text}"
    else:
        text = _without_dynamo_appendix(str(error)) or type(error).__name__
    notes = [str(n) for n in getattr(error, "__notes__", ())]
    if notes:
        text += f" ({'; '.join(notes)})"
    return " ".join(text.split())


def _without_dynamo_appendix(message: str) -> str:
    for marker in _DYNAMO_APPENDIX:
        message = message.split(marker, 1)[0]
    return message.strip()


def user_frame(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the user's code in ``error`` (or what caused it), or None.

    The user's code is any file outside functrain, torch, the standard library and installed packages.
    An exception raised in code that torch.compile traced names the traced stack's innermost user frame.
    """
    for exc in (error.__cause__, error):  # build errors chain the user's exception as the cause
        if exc is None:
            continue
        traced = getattr(exc, "innermost_user_frame_summary", None)  # set by dynamo
        if traced is not None and not _outside_user_code(traced.filename):
            return f"{traced.filename}:{traced.lineno}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _outside_user_code(f.filename)]
        if frames:
            return f"{frames[-1].filename}:{frames[-1].lineno}"
    return None


def _outside_user_code(filename: str) -> bool:
    if filename.startswith("<"):  # <string>, <frozen ...>
        return True
    path = os.path.realpath(filename)
    return path.startswith(_NOT_USER) or "torch" in Path(path).parts


def report(command: str, error: BaseException, status: int, *, debug: bool = False) -> int:
    """Print ``functrain COMMAND: MESSAGE`` on one line, with the user's frame ``(at file:line)`` where
    the error came from their code, and the traceback before it when ``debug``; returns ``status``.

    Example:
        >>> report("eval", FileNotFoundError("nope.ckpt: no such file"), 2)  # doctest: +SKIP
        functrain eval: nope.ckpt: no such file
    """
    message = one_line(error)
    if not (getattr(error, "problems", None) or isinstance(error, _SELF_DESCRIBING)):
        message = f"{type(error).__name__}: {message}"
    where = user_frame(error)
    if where:
        message += f" (at {where})"
    if not debug and (status == 1 or error.__cause__ is not None):
        message += f"; pass --debug (or set {DEBUG_ENV}=1) for the traceback"
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    print(f"functrain {command}: {message}", file=sys.stderr)
    return status
