"""``config_help()``: every config field with its dotted path, type, default and meaning.

This is what ``functrain train --help-config`` prints.

Example:
    >>> text = config_help()
    >>> "optimizer.lr: float = 0.001" in text and "early_stopping.patience" in text
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from functrain.config.coerce import describe_type
from functrain.config.section import ConfigSection, field_docs, section_of
from functrain.config.trainer_config import TrainerConfig

__all__ = ["SECURITY_NOTE", "config_help"]

SECURITY_NOTE = """\
Security: a config file is code. Its import specs ('module:attr' and {target: 'module:attr', args: [...],
kwargs: {...}}: model, the datasets, and criterion.name given as a spec) import the named modules and call
what they name ({target: 'os:system', args: [...]} runs a shell command), and validating the config
already imports those modules. Trust a config file as you would a Python script. Set
FUNCTRAIN_ALLOWED_MODULES=mod1,mod2 to allow only those modules (and their submodules) in specs: a
guard against surprises, not a sandbox.
"""

_BOUNDS = (("minimum", ">="), ("greater_than", ">"), ("maximum", "<="), ("less_than", "<"))


def config_help(root: type[ConfigSection] = TrainerConfig) -> str:
    """A plain-text listing of every field of ``root`` (sections expanded): path, type, default, meaning.

    Example:
        >>> print(config_help().splitlines()[2])
        output_dir: str = outputs
    """
    lines = [
        "TrainerConfig fields: set them in the YAML file, or on the command line as path=value "
        "(values are YAML: optimizer.lr=3e-4 metrics=[accuracy,f1]).",
        "",
    ]
    _describe(root, "", lines)
    lines += SECURITY_NOTE.splitlines()
    return "\n".join(lines).rstrip() + "\n"


def _describe(cls: type[ConfigSection], prefix: str, lines: list[str]) -> None:
    for f, hint in field_docs(cls):
        path = prefix + f.name
        section = section_of(hint)
        if section is not None:
            off = " (null: off)" if f.default is None else ""
            lines += [f"{path}: section{off}", f"    {f.metadata['help']}", ""]
            _describe(section, path + ".", lines)
            continue
        bounds = ", ".join(
            f"{op} {f.metadata[key]}" for key, op in _BOUNDS if f.metadata.get(key) is not None
        )
        shown_bounds = f"  (must be {bounds})" if bounds else ""
        lines += [
            f"{path}: {describe_type(hint)} = {_default(f)}{shown_bounds}",
            f"    {f.metadata['help']}",
            "",
        ]


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        value = f.default
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()
