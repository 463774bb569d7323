"""The ``functrain`` command: train, eval, predict, demo, inspect, export, plot.

    functrain demo                                  # a CNN on scikit-learn's digits, on the CPU
    functrain train run.yaml optimizer.lr=3e-4      # a run from a config file, with overrides
    functrain eval run.yaml [--checkpoint CKPT]     # evaluate a trained run
    functrain predict run.yaml --output preds.ckpt  # predictions: functrain.checkpoint.restore(path)["preds"]
    functrain inspect CKPT / export CKPT --format safetensors --output model.safetensors
    functrain plot RUN_DIR                          # loss and metric curves to a PNG
    functrain summary run.yaml                      # the model's params per module, trainable/frozen
    functrain train --help-config                   # every config field with its default and meaning

In a config file the model and the datasets are import specs: ``model: mypkg.models:Net`` (a class or
a function is called with no arguments, any other object used as it is), or ``{target: mypkg.data:load,
args: [...], kwargs: {...}}``. Modules are imported from the config file's directory, then the current
directory, then the installed packages (and ``PYTHONPATH``): ``mytask.py`` beside ``run.yaml`` just works.

Example:
    >>> main(["train", "--help-config"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

_SPECS_HELP = """\
model and datasets in CONFIG.yaml are import specs, 'module:attr' (a class or a function is called
with no arguments) or {target: 'module:attr', args: [...], kwargs: {...}}. Modules are imported from
the config file's directory, then the current directory, then the installed packages and PYTHONPATH:
  model: mytask:Net                 # mytask.py beside run.yaml
  train_dataset: mytask:train_set   # a function returning the dataset"""


def _build_trainer(config_path: str, overrides: Sequence[str]) -> Any:
    from functrain.config import ConfigError, TrainerConfig, add_import_dirs, build_object
    from functrain.trainer import Trainer

    # mytask.py beside run.yaml (or in the current directory) imports without PYTHONPATH
    add_import_dirs(
        {
            "the config's directory": os.path.dirname(os.path.abspath(config_path)),
            "the current directory": ".",
        }
    )
    cfg = TrainerConfig.from_yaml(config_path)
    if overrides:
        cfg = cfg.with_overrides(list(overrides))
    if cfg.model is None:
        raise ConfigError.single("model", "the config names no model", "set model: package.module:ModelClass")
    if cfg.train_dataset is None and cfg.eval_dataset is None:
        raise ConfigError.single(
            "train_dataset", "the config names no dataset", "set train_dataset: package.module:load_train"
        )

    def build(spec: Any, path: str) -> Any:
        return None if spec is None else build_object(spec, path=path)

    import torch

    torch.manual_seed(cfg.seed)
    model = build(cfg.model, "model")
    trainer = Trainer(
        model,
        cfg,
        train_dataset=build(cfg.train_dataset, "train_dataset"),
        eval_dataset=build(cfg.eval_dataset, "eval_dataset"),
    )
    trainer.test_dataset = build(cfg.test_dataset, "test_dataset")
    return trainer


def _latest_checkpoint(trainer: Any) -> str:
    manager = trainer.checkpoint_manager()
    best = manager.best() if trainer.config.load_best_model_at_end and manager.best_metric else None
    step = best if best is not None else manager.latest()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}; train first or pass --checkpoint")
    return manager.path(step)


def _train(args: argparse.Namespace) -> int:
    if args.help_config:
        from functrain.config import config_help

        print(config_help())
        return 0
    if args.config is None:
        print("functrain train: give a CONFIG.yaml (or --help-config)", file=sys.stderr)
        return 2
    from functrain import distributed, ensemble

    with distributed.initialize():  # torchrun: one process per device; plain python: a no-op
        trainer = _build_trainer(args.config, [*args.overrides, *(f"sweep.{s}" for s in args.sweep)])
        result = trainer.train(
            additional_epochs=args.additional_epochs, additional_steps=args.additional_steps
        )
        summary = dict(result.eval_metrics or {})
        if getattr(trainer, "test_dataset", None) is not None:
            summary.update(
                {k.replace("eval/", "test/"): v for k, v in trainer.evaluate(trainer.test_dataset).items()}
            )
        if distributed.is_main_process():
            step = ensemble.run_step(result.state)
            if trainer.config.sweep:
                best = trainer.sweep_best
                summary = {"best_member": best, **trainer.sweep_members[best], **summary}
            print(json.dumps({"step": step, **summary, "stop_reason": result.stop_reason}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    trainer = _build_trainer(args.config, args.overrides)
    trainer.load(args.checkpoint or _latest_checkpoint(trainer))
    dataset = trainer.test_dataset if args.split == "test" else trainer.eval_dataset
    if dataset is None:
        print(f"functrain eval: the config has no {args.split}_dataset", file=sys.stderr)
        return 2
    print(json.dumps(trainer.evaluate(dataset)))
    return 0


def _predict(args: argparse.Namespace) -> int:
    from functrain import checkpoint, ensemble, tree

    trainer = _build_trainer(args.config, args.overrides)
    trainer.load(args.checkpoint or _latest_checkpoint(trainer))
    dataset = {"test": trainer.test_dataset, "eval": trainer.eval_dataset, "train": trainer.train_dataset}[
        args.split
    ]
    if dataset is None:
        print(f"functrain predict: the config has no {args.split}_dataset", file=sys.stderr)
        return 2
    preds = trainer.predict(dataset)
    checkpoint.save(args.output, {"preds": preds}, step=ensemble.run_step(trainer.state))
    print(
        f"wrote {tree.map(lambda x: tuple(x.shape), preds)} predictions to {args.output}; read them with "
        f"functrain.checkpoint.restore({args.output!r})['preds']"
    )
    return 0


def _summary(args: argparse.Namespace) -> int:
    from functrain.model_summary import summary

    trainer = _build_trainer(args.config, args.overrides)
    print(summary(trainer.model, frozen=trainer.frozen, max_depth=args.depth))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from functrain import demo

    fields: dict[str, Any] = {"compile": not args.no_compile, "overwrite_output_dir": True}
    if args.epochs is not None:
        fields["epochs"] = args.epochs
    results = demo.run(args.output_dir, overrides=args.overrides, **fields)
    return 0 if results["eval/accuracy"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``functrain`` command."""
    from functrain.checkpoint import cli as checkpoint_cli
    from functrain.logging import cli as logging_cli

    parser = argparse.ArgumentParser(
        prog="functrain",
        description="functional, JAX-style training for PyTorch",
        epilog=_SPECS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train from a YAML config (key=value overrides allowed)",
        epilog=_SPECS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", metavar="CONFIG.yaml")
    train.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optimizer.lr=3e-4"
    )
    train.add_argument("--help-config", action="store_true", help="list every config field with its default")
    train.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="train these values side by side as one ensemble (repeatable: the grid of all), e.g. "
        "--sweep optimizer.lr=1e-3,3e-3 --sweep seed=0,1",
    )
    more = train.add_mutually_exclusive_group()
    more.add_argument(
        "--additional-epochs",
        type=int,
        metavar="N",
        help="train N more epochs from the resumed step (with resume_from_checkpoint=true), also past an "
        "early stop; epochs/max_steps count the whole run, so a finished run resumed without this returns at once",
    )
    more.add_argument(
        "--additional-steps", type=int, metavar="N", help="train N more optimizer steps (as above)"
    )
    train.set_defaults(func=_train)

    for name, fn, helptext in (
        ("eval", _eval, "evaluate a trained run"),
        ("predict", _predict, "write predictions"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("config", metavar="CONFIG.yaml")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
        p.add_argument("--checkpoint", help="checkpoint file (default: the run's latest, or best)")
        p.add_argument(
            "--split", choices=("eval", "test", "train"), default="test" if name == "predict" else "eval"
        )
        if name == "predict":
            p.add_argument(
                "--output",
                required=True,
                help="file for the predictions, a functrain checkpoint (msgpack, no pickle); read it in Python "
                "with functrain.checkpoint.restore(PATH)['preds'] (a tensor, one row per example)",
            )
        p.set_defaults(func=fn)

    summ = sub.add_parser("summary", help="print the model's parameters per module (trainable/frozen, bytes)")
    summ.add_argument("config", metavar="CONFIG.yaml")
    summ.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    summ.add_argument("--depth", type=int, default=None, help="group by the first DEPTH module levels")
    summ.set_defaults(func=_summary)

    demo = sub.add_parser("demo", help="train a small CNN on scikit-learn's digits (CPU, ~1 minute)")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--epochs", type=int, default=None)
    demo.add_argument("--no-compile", action="store_true", help="run the steps eagerly")
    demo.set_defaults(func=_demo)

    checkpoint_cli.register(sub)
    logging_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``functrain`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Configuration mistakes print the error (every problem, with its field and fix) and return 2.
    """
    from functrain.config.errors import ConfigError  # light: `functrain --help` imports no torch

    try:
        args = build_parser().parse_args(argv)
        try:
            status = int(args.func(args) or 0)
        except (ConfigError, FileExistsError, FileNotFoundError) as err:
            print(f"functrain {args.command}: {err}", file=sys.stderr)
            return 2
        sys.stdout.flush()  # a short output meets a closed pipe only here
        return status
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """Stdout's reader left (``functrain inspect CKPT | head``): stop quietly, as Unix tools do.

    What is still buffered goes to devnull, so that Python's flush at exit does not fail again. The
    status is 141 (128 + SIGPIPE), what a shell reports for a tool that a closed pipe ended, e.g.
    ``yes | head``: the output was cut short, so not 0, and ``set -o pipefail`` treats both alike.
    """
    with contextlib.suppress(OSError, ValueError):  # stdout is not a file descriptor (replaced, or closed)
        stdout = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout)
        os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
