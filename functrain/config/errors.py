"""`ConfigError`: every problem of a configuration at once, each with its field path and a fix.

A user who fixes one typo, reruns and meets the next one wastes a run per mistake, so validation collects
all problems before raising. Each :class:`Problem` names the dotted field path (``"optimizer.lr"``), says
what is wrong and what to write instead.

Example:
    >>> err = ConfigError([Problem("optimizer.lr", "must be > 0, got -1", "set optimizer.lr=1e-3")])
    >>> print(err)
    1 problem in the trainer config:
      - optimizer.lr: must be > 0, got -1. Fix: set optimizer.lr=1e-3
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ConfigError", "Problem", "did_you_mean"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration: where (dotted ``path``), what (``message``), and the ``fix``.

    Example:
        >>> Problem("epochs", "must be >= 1, got 0", "set epochs to 1 or more").path
        'epochs'
    """

    path: str
    message: str
    fix: str
    line: int | None = None  # the line in the config file, where the problem came from one

    def __str__(self) -> str:
        where = self.path or "<config>"
        if self.line is not None:
            where += f" (line {self.line})"
        return f"{where}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A configuration is invalid; ``problems`` lists every problem found, each with its field path.

    Example:
        >>> try:
        ...     raise ConfigError([Problem("epochs", "missing", "set epochs=3")])
        ... except ValueError as err:
        ...     [p.path for p in err.problems]
        ['epochs']
    """

    def __init__(self, problems: Sequence[Problem], *, source: str | None = None) -> None:
        if not problems:
            raise ValueError("ConfigError needs at least one Problem")
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.source = source  # the file (or "<yaml text>") the config was read from, if any
        super().__init__(self._message())

    def _message(self) -> str:
        noun = "problem" if len(self.problems) == 1 else "problems"
        where = f" {self.source}" if self.source else ""
        lines = [f"{len(self.problems)} {noun} in the trainer config{where}:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def in_source(self, source: str, lines: Mapping[str, int] | None = None) -> ConfigError:
        """This error (itself, changed in place) naming the config file ``source`` and, for problems whose
        path is in ``lines`` (field path -> line), the line.

        Example:
            >>> err = ConfigError([Problem("epochs", "must be >= 1, got 0", "set epochs=3")])
            >>> print(err.in_source("run.yaml", {"epochs": 4}))
            1 problem in the trainer config run.yaml:
              - epochs (line 4): must be >= 1, got 0. Fix: set epochs=3
        """
        lines = lines or {}
        self.source = source
        self.problems = tuple(
            p if p.line is not None else dataclasses.replace(p, line=_line_of(p.path, lines))
            for p in self.problems
        )
        self.args = (self._message(),)
        return self

    @classmethod
    def single(cls, path: str, message: str, fix: str) -> ConfigError:
        """A `ConfigError` with one problem.

        Example:
            >>> ConfigError.single("seed", "must be >= 0", "set seed=42").problems[0].fix
            'set seed=42'
        """
        return cls([Problem(path, message, fix)])

    @property
    def paths(self) -> list[str]:
        """The field paths of all problems, in the order they were found."""
        return [p.path for p in self.problems]


def _line_of(path: str, lines: Mapping[str, int]) -> int | None:
    """The line of ``path`` or of its nearest enclosing field (``optimizer.lr`` -> ``optimizer``)."""
    while path:
        if path in lines:
            return lines[path]
        path = re.sub(r"(\.[^.\[\]]*|\[\d+\])$", "", path) if re.search(r"[.\[]", path) else ""
    return None


def did_you_mean(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> list[str]:
    """The candidates closest to ``name`` (case-insensitive), best first, at most three.

    Names made of the same words in another order come first, alone (``cosine_warmup`` ->
    ``warmup_cosine``, which plain edit distance ranks below ``cosine``).

    Example:
        >>> did_you_mean("lrr", ["lr", "args", "name"])
        ['lr']
        >>> did_you_mean("cosine_warmup", ["cosine", "warmup_cosine", "linear"])
        ['warmup_cosine']
    """
    by_lower: dict[str, str] = {}
    for candidate in candidates:
        by_lower.setdefault(candidate.lower(), candidate)
    words = _words(name)
    same_words = [c for low, c in by_lower.items() if len(words) > 1 and _words(low) == words]
    if same_words:
        return same_words[:3]
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=cutoff)
    return [by_lower[m] for m in matches]


def _words(name: str) -> frozenset[str]:
    return frozenset(w for w in re.split(r"[_\-\s.]+", name.lower()) if w)


def suggestion(name: str, candidates: Iterable[str]) -> str:
    """``"did you mean 'x'?"`` for the closest candidates, or an empty string when none is close."""
    close = did_you_mean(name, candidates)
    if not close:
        return ""
    return "did you mean " + " or ".join(repr(c) for c in close) + "?"
