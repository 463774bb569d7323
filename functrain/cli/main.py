"""The ``functrain`` command: train, eval, predict, demo, inspect, export, plot.

    functrain demo                                  # a CNN on scikit-learn's digits, on the CPU
    functrain train run.yaml optimizer.lr=3e-4      # a run from a config file, with overrides
    functrain train --resume runs/sig               # continue that run (its saved config.yaml)
    functrain eval run.yaml [--checkpoint CKPT]     # evaluate a trained run: its step, checkpoint, metrics
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
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from functrain.cli.checks import load_config, preflight
from functrain.cli.errors import BuildError, debug_requested, report

__all__ = ["main", "run"]

_SPECS_HELP = """\
model and datasets in CONFIG.yaml are import specs, 'module:attr' (a class or a function is called
with no arguments) or {target: 'module:attr', args: [...], kwargs: {...}}. Modules are imported from
the config file's directory, then the current directory, then the installed packages and PYTHONPATH:
  model: mytask:Net                 # mytask.py beside run.yaml
  train_dataset: mytask:train_set   # a function returning the dataset"""

_DEBUG_HELP = "print the traceback of an error too (or set FUNCTRAIN_DEBUG=1)"
_EXIT_HELP = """\
exit status: 0 done; 2 a user error (config, override, missing file, checkpoint, an error building the
model or data), one line on stderr naming the fix; 1 any other failure; 143 (SIGTERM) or 130 (SIGINT):
training was preempted, its checkpoint saved: continue it with the printed command, functrain train
--resume OUTPUT_DIR; 141 stdout closed. --debug (or FUNCTRAIN_DEBUG=1) adds the traceback to an error."""


def _build_trainer(config_path: str | None, overrides: Sequence[str], *, resume: str | None = None) -> Any:
    from functrain.config import add_import_dirs

    # mytask.py beside run.yaml (or in the current directory) imports without PYTHONPATH; a resumed run
    # imports from where its config was first read (its launch.json)
    add_import_dirs(_import_dirs(config_path, resume))
    cfg, _ = load_config(config_path, overrides, resume=resume)
    return trainer_from_config(cfg)


def trainer_from_config(cfg: Any) -> Any:
    """:func:`functrain.trainer.from_config.trainer_from_config`, the user's exceptions (their model or
    dataset code) raised as a :class:`BuildError` the CLI reports in one line naming their file."""
    from functrain.config import ConfigError
    from functrain.trainer.from_config import trainer_from_config as build_trainer

    try:
        return build_trainer(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # the user's model or data code, or objects the Trainer cannot take
        raise BuildError(f"building the run's model and datasets raised {type(exc).__name__}: {exc}") from exc


# Written by `functrain train` into its run directory: where the config's import specs were imported from,
# so that `functrain train --resume RUN_DIR` imports the same modules from anywhere.
_LAUNCH = "launch.json"


def _import_dirs(config_path: str | None, resume: str | None = None) -> dict[str, str]:
    """Where the config's import specs are imported from: the config's directory and the current one, or
    for ``--resume RUN_DIR`` the directories the run recorded (its ``launch.json``) and the current one."""
    if resume is None:
        config_dir = os.path.dirname(os.path.abspath(str(config_path)))
        return {"the config's directory": config_dir, "the current directory": "."}
    recorded = {f"import directory {i} of the run": d for i, d in enumerate(_recorded_import_dirs(resume), 1)}
    return {**recorded, "the current directory": "."}


def _recorded_import_dirs(run_dir: str) -> list[str]:
    """The import directories a run recorded (its ``launch.json``), first searched first."""
    try:
        dirs = json.loads((Path(run_dir) / _LAUNCH).read_text())["import_dirs"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else []


def _record_launch(trainer: Any, dirs: dict[str, str]) -> None:
    """Have ``trainer`` write ``launch.json`` into its run directory once it exists (rank 0, train begin):
    its import directories, absolute (a ``--resume`` may run from another directory)."""
    from functrain import distributed
    from functrain.callbacks import LambdaCallback
    from functrain.config.yaml_io import write_text_atomic

    record = {"import_dirs": list(dict.fromkeys(os.path.abspath(d) for d in dirs.values()))}

    def write(state: Any, ctx: Any) -> Any:
        if distributed.is_main_process():
            write_text_atomic(Path(trainer.config.output_dir) / _LAUNCH, json.dumps(record, indent=1) + "\n")
        return state

    trainer.extra_callbacks.append(LambdaCallback("launch_record", on_train_begin=write))


def _run_length(trainer: Any) -> dict[str, int]:
    """``{"total": N}``, the run's length in optimizer steps, filled in as ``trainer`` begins training."""
    from functrain.callbacks import LambdaCallback

    seen: dict[str, int] = {}

    def note(state: Any, ctx: Any) -> Any:
        seen["total"] = int(ctx.max_steps)
        return state

    trainer.extra_callbacks.append(LambdaCallback("run_length", on_train_begin=note))
    return seen


def _latest_checkpoint(trainer: Any, command: str = "eval") -> str:
    """The run's checkpoint to read: the best (``load_best_model_at_end``) or the newest readable one; a
    newer file that cannot be read is said on stderr, with the step read instead."""
    manager = trainer.checkpoint_manager()
    best = manager.best() if trainer.config.load_best_model_at_end and manager.best_metric else None
    step = best if best is not None else manager.latest()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}; train first or pass --checkpoint")
    newer = [s for s in manager.all_steps() if s > step]
    if best is None and newer:
        print(
            f"functrain {command}: the newest checkpoint, {manager.path(newer[-1])}, cannot be read; "
            f"using step {step} ({manager.path(step)})",
            file=sys.stderr,
        )
    return manager.path(step)


def _preempted_status(stop_reason: str) -> int:
    """128 + the signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a signalled
    process: a scheduler tells a preempted (resumable) run from a finished one."""
    import signal

    name = stop_reason.rpartition(" ")[2]
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return 128 + int(signal.SIGTERM)


def _train(args: argparse.Namespace) -> int:
    if args.help_config:
        from functrain.config import config_help

        print(config_help())
        return 0
    config, overrides = args.config, [*args.overrides, *(f"sweep.{s}" for s in args.sweep)]
    if args.resume is not None and config is not None:
        if "=" not in config:
            print("functrain train: give a CONFIG.yaml or --resume RUN_DIR, not both", file=sys.stderr)
            return 2
        config, overrides = None, [config, *overrides]  # `--resume DIR epochs=80`: an override
    if config is None and args.resume is None:
        print("functrain train: give a CONFIG.yaml, --resume RUN_DIR (or --help-config)", file=sys.stderr)
        return 2
    preflight("train", config, overrides, resume=args.resume)  # before torch and the user's code
    from functrain import distributed, ensemble

    with distributed.initialize():  # torchrun: one process per device; plain python: a no-op
        trainer = _build_trainer(config, overrides, resume=args.resume)
        _record_launch(trainer, _import_dirs(config, args.resume))  # for the next --resume
        length = _run_length(trainer)
        result = trainer.train(
            additional_epochs=args.additional_epochs, additional_steps=args.additional_steps
        )
        summary = dict(result.eval_metrics or {})
        if getattr(trainer, "test_dataset", None) is not None and not result.preempted:
            summary.update(
                {k.replace("eval/", "test/"): v for k, v in trainer.evaluate(trainer.test_dataset).items()}
            )
        step = ensemble.run_step(result.state)
        is_main = distributed.is_main_process()
        if is_main:
            if trainer.config.sweep:
                best = trainer.sweep_best
                summary = {"best_member": best, **trainer.sweep_members[best], **summary}
            print(json.dumps({"step": step, **summary, "stop_reason": result.stop_reason}))
    if not result.preempted:
        return 0
    status = _preempted_status(result.stop_reason)
    if is_main:
        extending = args.additional_epochs is not None or args.additional_steps is not None
        rest = length.get("total", step) - step
        command = ["functrain", "train", "--resume", trainer.config.output_dir]
        command += ["--additional-steps", str(rest)] if extending and rest > 0 else []
        print(
            f"functrain train: {result.stop_reason} at step {step}, checkpoint saved (exit status {status}); "
            f"continue with: {shlex.join(command)}",
            file=sys.stderr,
        )
    return status


def _trained(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """eval/predict: the checks, then the Trainer with the checkpoint loaded, the ``--split`` dataset, and
    the checkpoint's path."""
    preflight(args.command, args.config, args.overrides, split=args.split, checkpoint=args.checkpoint)
    trainer = _build_trainer(args.config, args.overrides)
    path = args.checkpoint or _latest_checkpoint(trainer, args.command)
    trainer.load(path)
    dataset = {"test": trainer.test_dataset, "eval": trainer.eval_dataset, "train": trainer.train_dataset}[
        args.split
    ]
    if dataset is None:  # named in the config, but its spec built None
        raise BuildError(f"{args.split}_dataset built None; its spec must return a dataset")
    return trainer, dataset, os.fspath(path)


def _eval(args: argparse.Namespace) -> int:
    trainer, dataset, path = _trained(args)
    from functrain import ensemble

    metrics = trainer.evaluate(dataset)
    print(json.dumps({"step": ensemble.run_step(trainer.state), "checkpoint": path, **metrics}))
    return 0


def _predict(args: argparse.Namespace) -> int:
    trainer, dataset, _ = _trained(args)
    from functrain import checkpoint, ensemble, tree

    preds = trainer.predict(dataset)
    checkpoint.save(args.output, {"preds": preds}, step=ensemble.run_step(trainer.state))
    print(
        f"wrote {tree.map(lambda x: tuple(x.shape), preds)} predictions to {args.output}; read them with "
        f"functrain.checkpoint.restore({args.output!r})['preds']"
    )
    return 0


def _summary(args: argparse.Namespace) -> int:
    preflight("summary", args.config, args.overrides)
    from functrain.model_summary import summary

    trainer = _build_trainer(args.config, args.overrides)
    print(summary(trainer.model, frozen=trainer.frozen, max_depth=args.depth))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from functrain.trainer import demo

    results = demo.run("runs/demo", overrides=args.overrides, overwrite_output_dir=True)
    return 0 if results["eval/accuracy"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``functrain`` command."""
    from functrain.checkpoint import cli as checkpoint_cli
    from functrain.logging import cli as logging_cli

    parser = argparse.ArgumentParser(
        prog="functrain",
        description="functional, JAX-style training for PyTorch",
        epilog=f"{_SPECS_HELP}\n\n{_EXIT_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train from a YAML config (key=value overrides allowed)",
        epilog=f"{_SPECS_HELP}\n\n{_EXIT_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", metavar="CONFIG.yaml")
    train.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optimizer.lr=3e-4"
    )
    train.add_argument("--help-config", action="store_true", help="list every config field with its default")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR (an output_dir) from its latest checkpoint, with the config it "
        "saved there (config.yaml; KEY=VALUE overrides still apply), instead of a CONFIG.yaml",
    )
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
        help="train N more epochs from the resumed step (with --resume RUN_DIR), also past an "
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
    demo.set_defaults(func=_demo)

    checkpoint_cli.register(sub)
    logging_cli.register(sub)
    for (
        command
    ) in sub.choices.values():  # `functrain train run.yaml --debug` as well as `functrain --debug ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``functrain`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    A user error (config, override, missing file, checkpoint, an exception while building the user's
    model or data) prints one line, ``functrain COMMAND: what is wrong. Fix: ...``, and returns 2; any
    other failure one line and 1 (``--debug`` or ``FUNCTRAIN_DEBUG=1``: the traceback too). A training
    run preempted by SIGTERM/SIGINT (checkpoint saved, resumable) returns 143/130 (128 + the signal).
    """
    from functrain.checkpoint.errors import CheckpointError
    from functrain.config.errors import ConfigError  # light: `functrain --help` imports no torch

    args = _parse(build_parser(), argv)  # a bad command line: argparse's usage and status 2
    debug = debug_requested(args.debug)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a short output meets a closed pipe only here
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        print(f"functrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, CheckpointError, BuildError, FileExistsError, FileNotFoundError) as err:
        return report(args.command, err, 2, debug=debug)
    except Exception as err:
        return report(args.command, err, 1, debug=debug)


def run(argv: Sequence[str] | None = None) -> None:
    """The console entry (``functrain ...``, ``python -m functrain ...``): :func:`main`, then exit with
    its status.

    A rank launched by torchrun ends with ``os._exit`` once its output is flushed: about one gloo run in
    50 to 100 aborted after finishing (``terminate called without an active exception``, exit -6, no
    Python frame left: C++ teardown during interpreter finalization; measured on 2 CPU ranks, seen in
    CI for ``torchrun -m functrain train`` after its summary line), and a scheduler would read the
    finished run as failed. By then the Trainer has closed its loggers and checkpoints and destroyed
    the process group.
    """
    status = main(argv)
    # torchrun sets TORCHELASTIC_RUN_ID; other launchers a WORLD_SIZE (string compare: a malformed one was
    # already reported by main, and must not raise here)
    if "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        import logging

        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    sys.exit(status)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; KEY=VALUE overrides may also follow the options (``predict run.yaml --output p.ckpt
    test_dataset=mytask:val_set``), where argparse alone would refuse them."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not (hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra)):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


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
