"""Tests for functrain.config: validation corpus, YAML round trip, overrides, help, import specs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from functrain.config import (
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    ConfigError,
    EarlyStoppingConfig,
    OptimizerConfig,
    TrainerConfig,
    config_help,
    metric_mode,
    resolve_object,
)
from functrain.config.section import leaf_paths

# ------------------------------------------------------------------------------------ bad config corpus

# (mapping given to from_dict, field path that must be named, text the problem must contain)
BAD_CONFIGS: list[tuple[dict[str, Any], str, str]] = [
    # unknown keys and misspellings
    ({"epochs": 1, "epoch": 2}, "epoch", "did you mean 'epochs'"),
    ({"epochs": 1, "optimizer": {"lrr": 0.1}}, "optimizer.lrr", "did you mean 'optimizer.lr'"),
    ({"epochs": 1, "schedular": {"name": "cosine"}}, "schedular", "did you mean 'scheduler'"),
    ({"epochs": 1, "patience": 3}, "patience", "'early_stopping.patience'"),
    ({"epochs": 1, "learning_rate": 0.1}, "learning_rate", "'optimizer.lr'"),
    ({"epoch_num": 2}, "epoch_num", "'epochs'"),
    ({"epochs": 1, "freeze_bn": True}, "freeze_bn", "'freeze.batchnorm'"),
    (
        {"epochs": 1, "early_stopping": {"patiense": 2}},
        "early_stopping.patiense",
        "'early_stopping.patience'",
    ),
    # unknown names
    ({"epochs": 1, "optimizer": {"name": "adamm"}}, "optimizer.name", "did you mean 'adam'"),
    ({"epochs": 1, "scheduler": {"name": "cosin"}}, "scheduler.name", "did you mean 'cosine'"),
    (
        {"epochs": 1, "criterion": {"name": "CrossEntropyLos"}},
        "criterion.name",
        "did you mean 'CrossEntropyLoss'",
    ),
    ({"epochs": 1, "criterion": "MSELos"}, "criterion.name", "'MSELoss'"),
    (
        {"epochs": 1, "criterion": {"args": {"label_smoothin": 0.1}}},
        "criterion.args.label_smoothin",
        "'label_smoothing'",
    ),
    ({"epochs": 1, "eval_strategy": "step"}, "eval_strategy", "did you mean 'steps'"),
    ({"epochs": 1, "mixed_precision": "fp32"}, "mixed_precision", "'no', 'bf16', 'fp16'"),
    ({"epochs": 1, "compile_mode": "fast"}, "compile_mode", "'reduce-overhead'"),
    ({"epochs": 1, "device": "gpu"}, "device", "'cuda:N'"),
    ({"epochs": 1, "device": "cuda:x"}, "device", "'cuda:N'"),
    # wrong types
    ({"epochs": "three"}, "epochs", "an integer"),
    ({"epochs": 1.5}, "epochs", "an integer"),
    ({"epochs": 1, "batch_size": True}, "batch_size", "an integer"),
    ({"epochs": 1, "optimizer": {"lr": "fast"}}, "optimizer.lr", "a number"),
    ({"epochs": 1, "optimizer": {"lr": float("nan")}}, "optimizer.lr", "finite"),
    ({"epochs": 1, "compile": "maybe"}, "compile", "true or false"),
    ({"epochs": 1, "output_dir": 5}, "output_dir", "a string"),
    ({"epochs": 1, "optimizer": 3}, "optimizer", "mapping"),
    ({"epochs": 1, "optimizer": {"args": [1, 2]}}, "optimizer.args", "mapping"),
    ({"epochs": 1, "optimizer": {"args": {"fn": object()}}}, "optimizer.args.fn", "cannot store"),
    ({"epochs": 1, "freeze": {"module_indices": ["a"]}}, "freeze.module_indices[0]", "an integer"),
    ({"epochs": 1, "metrics": [1]}, "metrics[0]", "metric name"),
    ({"epochs": 1, "metrics": ["f1", "f1"]}, "metrics[1]", "twice"),
    # bounds
    ({"epochs": 0}, "epochs", ">= 1"),
    ({"epochs": 1, "batch_size": -4}, "batch_size", ">= 1"),
    ({"epochs": 1, "optimizer": {"lr": 0}}, "optimizer.lr", "> 0"),
    ({"epochs": 1, "save_total_limit": 0}, "save_total_limit", ">= 1"),
    ({"epochs": 1, "gradient_accumulation_steps": 0}, "gradient_accumulation_steps", ">= 1"),
    ({"epochs": 1, "max_grad_norm": 0.0}, "max_grad_norm", "> 0"),
    ({"epochs": 1, "scheduler": {"warmup_ratio": 1.0}}, "scheduler.warmup_ratio", "< 1"),
    ({"epochs": 1, "early_stopping": {"patience": 0}}, "early_stopping.patience", ">= 1"),
    # contradictions
    ({}, "epochs", "set epochs=N or max_steps=N"),
    ({"epochs": 2, "max_steps": 100}, "max_steps", "keep only one"),
    ({"epochs": 1, "eval_strategy": "no", "early_stopping": {}}, "early_stopping", "eval_strategy"),
    (
        {"epochs": 1, "eval_strategy": "no", "load_best_model_at_end": True},
        "load_best_model_at_end",
        "evaluation",
    ),
    (
        {"epochs": 1, "save_strategy": "no", "load_best_model_at_end": True},
        "load_best_model_at_end",
        "checkpoints",
    ),
    (
        {"epochs": 1, "eval_strategy": "steps", "eval_steps": 10, "load_best_model_at_end": True},
        "save_strategy",
        "set save_strategy=steps",
    ),
    (
        {
            "epochs": 1,
            "eval_strategy": "steps",
            "eval_steps": 10,
            "save_strategy": "steps",
            "save_steps": 15,
            "load_best_model_at_end": True,
        },
        "save_steps",
        "multiple of 10",
    ),
    ({"epochs": 1, "eval_strategy": "steps"}, "eval_steps", "set eval_steps=N"),
    ({"epochs": 1, "eval_steps": 100}, "eval_steps", "only used with eval_strategy='steps'"),
    ({"epochs": 1, "save_strategy": "steps"}, "save_steps", "set save_steps=N"),
    ({"epochs": 1, "save_steps": 100}, "save_steps", "only used with save_strategy='steps'"),
    (
        {"epochs": 1, "scheduler": {"warmup_steps": 10, "warmup_ratio": 0.1}},
        "scheduler.warmup_ratio",
        "keep one of them",
    ),
    (
        {"epochs": 1, "scheduler": {"name": "one_cycle", "warmup_steps": 5}},
        "scheduler.warmup_steps",
        "pct_start",
    ),
    ({"max_steps": 10, "scheduler": {"warmup_steps": 10}}, "scheduler.warmup_steps", "below 10"),
    ({"epochs": 1, "mixed_precision": "fp16", "device": "cpu"}, "mixed_precision", "bf16"),
    ({"epochs": 1, "pin_memory": True, "device": "cpu"}, "pin_memory", "pin_memory=false"),
    ({"epochs": 1, "compile": False, "compile_mode": "max-autotune"}, "compile_mode", "compile=true"),
    ({"epochs": 1, "optimizer": {"args": {"lr": 0.1}}}, "optimizer.args.lr", "set optimizer.lr instead"),
    (
        {"epochs": 1, "init_weights_from": "a.ckpt", "resume_from_checkpoint": "runs/x/checkpoints/10"},
        "init_weights_from",
        "overwritten",
    ),
    (
        {"epochs": 1, "metric_for_best_model": "accuracy"},
        "metric_for_best_model",
        "add 'accuracy' to metrics",
    ),
    (
        {"epochs": 1, "metrics": ["accuracy"], "metric_for_best_model": "acuracy"},
        "metric_for_best_model",
        "did you mean 'accuracy'",
    ),
    ({"epochs": 1, "metrics": ["mystery"], "metric_for_best_model": "mystery"}, "best_model_mode", "=max or"),
    ({"epochs": 1, "early_stopping": {"monitor": "f1"}}, "early_stopping.monitor", "add 'f1' to metrics"),
    ({"epochs": 1, "output_dir": "  "}, "output_dir", "empty"),
    ({"epochs": 1, "metrics": ["loss"]}, "metrics.loss", "always evaluated"),
    # import specs
    ({"epochs": 1, "model": "torch.nnn:Linear"}, "model", "no module named 'torch.nnn'"),
    ({"epochs": 1, "model": "torch.nn:Linearr"}, "model", "did you mean 'Linear'"),
    ({"epochs": 1, "model": "torch.nn.Linear"}, "model", "torch.nn:Linear"),
    (
        {"epochs": 1, "train_dataset": {"target": "torch.nn:Linear", "kwarg": {}}},
        "train_dataset.kwarg",
        "'kwargs'",
    ),
    ({"epochs": 1, "eval_dataset": {"args": [1]}}, "eval_dataset.target", "missing"),
    ({"epochs": 1, "test_dataset": {"target": "math:pi", "args": 3}}, "test_dataset.args", "must be a list"),
    (
        {"epochs": 1, "criterion": {"name": "torch.nn:NoSuchLoss"}},
        "criterion.name",
        "has no attribute 'NoSuchLoss'",
    ),
    # a torch optimizer argument goes to the pass-through args, not "remove it"
    ({"epochs": 1, "optimizer": {"betas": [0.9, 0.95]}}, "optimizer.betas", "move it into optimizer.args"),
    ({"epochs": 1, "criterion": {"reduction": "sum"}}, "criterion.reduction", "criterion.args.reduction=..."),
    # the same words in another order beat edit distance
    (
        {"epochs": 1, "scheduler": {"name": "cosine_warmup"}},
        "scheduler.name",
        "did you mean 'warmup_cosine'?",
    ),
]


@pytest.mark.parametrize(
    ("data", "path", "text"), BAD_CONFIGS, ids=[f"{c[1]}:{c[2][:20]}" for c in BAD_CONFIGS]
)
def test_bad_config_names_field_and_fix(data: dict[str, Any], path: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainerConfig.from_dict(data)
    matching = [p for p in info.value.problems if p.path == path]
    assert matching, f"no problem at {path!r}; got {info.value}"
    assert any(text in f"{p.message}. Fix: {p.fix}" for p in matching), str(info.value)
    assert all(p.fix for p in info.value.problems)
    assert isinstance(info.value, ValueError)


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        TrainerConfig.from_dict(
            {"epochs": 0, "optimizer": {"lrr": 1, "name": "adamm"}, "batch_size": "x", "device": "gpu"}
        )
    assert set(info.value.paths) == {"epochs", "optimizer.lrr", "optimizer.name", "batch_size", "device"}
    assert str(info.value).startswith("5 problems in the trainer config:")


def test_rules_skip_fields_that_already_failed() -> None:
    # a bad eval_strategy must not also trigger "eval_steps only used with eval_strategy='steps'"
    with pytest.raises(ConfigError) as info:
        TrainerConfig(epochs=1, eval_strategy="step", eval_steps=10)
    assert info.value.paths == ["eval_strategy"]


def test_direct_construction_rejects_unknown_keyword_with_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        TrainerConfig(epochs=1, batchsize=8)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"did you mean 'optimizer\.lr'"):
        OptimizerConfig(lrr=1.0)  # type: ignore[call-arg]


def test_config_is_frozen_so_misspelled_attributes_cannot_be_set() -> None:
    config = TrainerConfig(epochs=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.epoch_num = 3  # type: ignore[attr-defined]
    assert config.replace(epochs=4).epochs == 4 and config.epochs == 1
    with pytest.raises(ConfigError, match="epochs"):
        config.replace(epochs=0)


def test_top_level_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        TrainerConfig.from_dict([1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ safe coercions


def test_safe_coercions_from_yaml_and_cli_text() -> None:
    config = TrainerConfig.from_dict(
        {
            "max_steps": "1e3",
            "batch_size": 64.0,
            "optimizer": {"name": "AdamW", "lr": "3e-4", "weight_decay": 0},
            "compile": "false",
            "eval_strategy": False,  # YAML 1.1 reads a bare `no` as false
            "save_strategy": "EPOCH",
            "mixed_precision": "BF16",
            "metrics": "accuracy",
            "freeze": ["encoder.*"],
            "early_stopping": False,
            "resume_from_checkpoint": "true",
        }
    )
    assert config.max_steps == 1000 and isinstance(config.max_steps, int)
    assert config.batch_size == 64 and isinstance(config.batch_size, int)
    assert config.optimizer.name == "adamw" and config.optimizer.lr == pytest.approx(3e-4)
    assert isinstance(config.optimizer.weight_decay, float)
    assert config.compile is False
    assert config.eval_strategy == "no" and config.save_strategy == "epoch"
    assert config.mixed_precision == "bf16"
    assert config.metrics == {"accuracy": {}}
    assert config.freeze.patterns == ["encoder.*"]
    assert config.early_stopping is None
    assert config.resume_from_checkpoint is True


def test_yaml_bare_no_is_the_choice_no() -> None:
    config = TrainerConfig.from_yaml("epochs: 1\neval_strategy: no\nsave_strategy: no\nmixed_precision: no\n")
    assert (config.eval_strategy, config.save_strategy, config.mixed_precision) == ("no", "no", "no")


def test_metrics_forms_normalize_to_one_mapping() -> None:
    as_list = TrainerConfig(epochs=1, metrics=["accuracy", {"f1": {"average": "macro"}}])
    as_map = TrainerConfig(epochs=1, metrics={"accuracy": None, "f1": {"average": "macro"}})
    assert as_list.metrics == as_map.metrics == {"accuracy": {}, "f1": {"average": "macro"}}


def test_shorthands_for_sections() -> None:
    config = TrainerConfig(
        epochs=1, optimizer="sgd", scheduler="cosine", criterion="MSELoss", early_stopping=True
    )
    assert config.optimizer == OptimizerConfig(name="sgd")
    assert config.scheduler.name == "cosine" and config.criterion.name == "MSELoss"
    assert config.early_stopping == EarlyStoppingConfig()


def test_resume_path_and_tuples_are_kept_as_plain_data() -> None:
    config = TrainerConfig(
        epochs=1, resume_from_checkpoint="runs/a/checkpoints/100", optimizer={"args": {"betas": (0.9, 0.95)}}
    )
    assert config.resume_from_checkpoint == "runs/a/checkpoints/100"
    assert config.optimizer.args == {"betas": [0.9, 0.95]}


def test_best_model_and_early_stopping_directions() -> None:
    config = TrainerConfig(
        epochs=1, metrics=["accuracy"], metric_for_best_model="accuracy", early_stopping={"monitor": "loss"}
    )
    assert config.resolved_best_model_mode == "max"
    assert config.early_stopping is not None and config.early_stopping.resolved_mode == "min"
    explicit = TrainerConfig(
        epochs=1, metrics=["custom"], metric_for_best_model="custom", best_model_mode="max"
    )
    assert explicit.resolved_best_model_mode == "max"
    assert metric_mode("val_loss") == "min" and metric_mode("F1Score") == "max" and metric_mode("xyz") is None


def test_eval_batch_size_defaults_to_batch_size() -> None:
    assert TrainerConfig(epochs=1, batch_size=16).resolved_eval_batch_size == 16
    assert TrainerConfig(epochs=1, batch_size=16, eval_batch_size=64).resolved_eval_batch_size == 64


def test_name_lists_are_the_documented_ones() -> None:
    assert OPTIMIZER_NAMES == ("sgd", "adam", "adamw", "rmsprop", "adagrad", "lion", "lamb")
    assert "warmup_cosine" in SCHEDULER_NAMES and "one_cycle" in SCHEDULER_NAMES
    for name in OPTIMIZER_NAMES:
        assert OptimizerConfig(name=name).name == name


# ------------------------------------------------------------------------------------ YAML


def _rich_config() -> TrainerConfig:
    return TrainerConfig(
        output_dir="runs/mlp",
        max_steps=500,
        batch_size=8,
        optimizer={"name": "adamw", "lr": 3e-4, "weight_decay": 0.01, "args": {"betas": [0.9, 0.95]}},
        scheduler={"name": "warmup_cosine", "warmup_ratio": 0.1},
        criterion={"name": "CrossEntropyLoss", "args": {"label_smoothing": 0.1}},
        metrics={"accuracy": {"top_k": 1}},
        eval_strategy="steps",
        eval_steps=50,
        save_strategy="steps",
        save_steps=100,
        save_total_limit=2,
        metric_for_best_model="accuracy",
        load_best_model_at_end=True,
        early_stopping={"monitor": "accuracy", "patience": 4, "min_delta": 1e-4},
        max_grad_norm=1.0,
        mixed_precision="bf16",
        device="cuda:1",
        compile_mode="max-autotune",
        freeze={"patterns": ["0.*"], "module_indices": [-1], "batchnorm": True},
        resume_from_checkpoint=True,
        model={"target": "torch.nn:Linear", "args": [4, 2]},
        train_dataset="torch.utils.data:TensorDataset",
    )


def test_yaml_round_trip_is_equal(tmp_path) -> None:
    config = _rich_config()
    assert TrainerConfig.from_yaml(config.to_yaml()) == config
    saved = config.save(tmp_path / "run" / "config.yaml")
    assert saved.is_file()
    assert TrainerConfig.from_yaml(saved) == config
    assert TrainerConfig.from_yaml(str(saved)) == config
    assert TrainerConfig.from_dict(config.to_dict()) == config
    assert not list((tmp_path / "run").glob(".config.yaml.*"))  # no temporary file left behind


def test_yaml_lists_every_field_in_order() -> None:
    text = TrainerConfig(epochs=1).to_yaml()
    top_keys = [line.split(":")[0] for line in text.splitlines() if line and not line.startswith(" ")]
    assert top_keys == [f.name for f in dataclasses.fields(TrainerConfig)]


def test_yaml_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        TrainerConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        TrainerConfig.from_yaml("epochs: [1,\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        TrainerConfig.from_yaml("- 1\n- 2\n")
    with pytest.raises(ConfigError) as info:
        TrainerConfig.from_yaml("epochs: 1\noptimizer:\n  lr: 0.1\n  lr: 0.2\n")
    assert info.value.paths == ["optimizer.lr"] and "appears twice" in str(info.value)


def test_yaml_is_safe() -> None:
    with pytest.raises(ConfigError, match="invalid YAML"):
        TrainerConfig.from_yaml("epochs: !!python/object/apply:os.system ['echo pwned']\n")


# ------------------------------------------------------------------------------------ overrides


def test_overrides_parse_values_as_yaml() -> None:
    base = TrainerConfig(epochs=1)
    config = base.with_overrides(
        [
            "optimizer.lr=3e-4",
            "epochs=5",
            "metrics=[accuracy,f1]",
            "compile=false",
            "optimizer.args.momentum=0.9",
            "optimizer.name=sgd",
            "max_grad_norm=null",
            "device=cuda:0",
        ]
    )
    assert config.optimizer.lr == pytest.approx(3e-4) and config.epochs == 5
    assert config.metrics == {"accuracy": {}, "f1": {}}
    assert config.compile is False and config.device == "cuda:0"
    assert config.optimizer.args == {"momentum": 0.9} and config.optimizer.name == "sgd"
    assert base.epochs == 1  # the original is untouched


def test_overrides_expand_null_and_shorthand_sections() -> None:
    config = TrainerConfig(epochs=1, optimizer="sgd").with_overrides(
        ["early_stopping.patience=5", "optimizer.lr=0.1"]
    )
    assert config.early_stopping == EarlyStoppingConfig(patience=5)
    assert config.optimizer == OptimizerConfig(name="sgd", lr=0.1)


def test_overrides_later_wins_and_intermediate_states_may_be_invalid() -> None:
    config = TrainerConfig(epochs=1).with_overrides(
        ["eval_strategy=steps", "eval_steps=20", "epochs=2", "epochs=3"]
    )
    assert (config.eval_strategy, config.eval_steps, config.epochs) == ("steps", 20, 3)


def test_bad_overrides_report_all_problems() -> None:
    with pytest.raises(ConfigError) as info:
        TrainerConfig(epochs=1).with_overrides(["optimizer.lrr=3", "epochs", "early_stopping.patience=0"])
    assert info.value.paths == ["epochs", "optimizer.lrr", "early_stopping.patience"]
    assert "did you mean 'optimizer.lr'" in str(info.value)
    assert "key=value" in str(info.value)


def test_override_into_a_scalar_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        TrainerConfig(epochs=1).with_overrides(["epochs.value=3"])
    assert info.value.paths == ["epochs"] and "set the whole value" in str(info.value)


# ------------------------------------------------------------------------------------ help


def test_help_lists_every_field_with_type_default_and_meaning() -> None:
    text = config_help()
    for path in leaf_paths(TrainerConfig):
        assert f"\n{path}: " in text, path
    assert "optimizer.lr: float = 0.001  (must be > 0)" in text
    assert "eval_strategy: 'auto' | 'no' | 'steps' | 'epoch' = auto" in text
    assert "early_stopping: section (null: off)" in text
    assert "Optimizer steps between evaluations" in text
    assert len(leaf_paths(TrainerConfig)) > 50


def test_every_field_has_a_help_string() -> None:
    from functrain.config.sections import CriterionConfig, FreezeConfig, SchedulerConfig

    for cls in (
        TrainerConfig,
        OptimizerConfig,
        SchedulerConfig,
        CriterionConfig,
        EarlyStoppingConfig,
        FreezeConfig,
    ):
        for f in dataclasses.fields(cls):
            assert f.metadata["help"].strip(), f"{cls.__name__}.{f.name}"


# ------------------------------------------------------------------------------------ import specs


def test_resolve_object_string_returns_attribute_uncalled() -> None:
    assert resolve_object("torch.nn:Linear") is torch.nn.Linear
    assert resolve_object("torch.nn:functional.relu") is torch.nn.functional.relu
    assert resolve_object("math:pi") == pytest.approx(3.14159, abs=1e-5)


def test_resolve_object_mapping_is_called_with_arguments() -> None:
    layer = resolve_object({"target": "torch.nn:Linear", "args": [4, 2], "kwargs": {"bias": False}})
    assert isinstance(layer, torch.nn.Linear)
    assert (layer.in_features, layer.out_features, layer.bias) == (4, 2, None)
    assert resolve_object({"target": "collections:Counter"}) == {}


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        ("torch.nnn:Linear", "no module named 'torch.nnn'"),
        ("no_such_package_xyz:thing", "no module named 'no_such_package_xyz'"),
        ("torch.nn:Linearr", "did you mean 'Linear'"),
        ("torch.nn", "not of the form"),
        ({"target": "torch.nn:Linear", "args": ["four"]}, "raised TypeError"),
        ({"target": "math:pi"}, "cannot be called"),
        ({"target": "math:sqrt", "kwargz": {}}, "did you mean 'kwargs'"),
        (3, "string or a mapping"),
    ],
)
def test_resolve_object_errors_name_the_spec(spec: Any, text: str) -> None:
    with pytest.raises(ConfigError, match="model") as info:
        resolve_object(spec, path="model")
    assert text in str(info.value)


def test_resolve_object_keeps_the_original_exception() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_object({"target": "torch.nn:Linear", "args": ["four"]})
    assert isinstance(info.value.__cause__, TypeError)


def test_config_specs_are_checked_but_not_called() -> None:
    config = TrainerConfig(epochs=1, model={"target": "torch.nn:Linear", "args": [3, 1]})
    assert config.model == {"target": "torch.nn:Linear", "args": [3, 1]}
    assert isinstance(resolve_object(config.model, path="model"), torch.nn.Linear)


def test_criterion_from_keywords_yaml_and_overrides_is_one_config_and_a_bad_name_names_its_line():
    new = TrainerConfig(epochs=1, criterion={"name": "MSELoss", "args": {"reduction": "sum"}})
    assert TrainerConfig.from_yaml("epochs: 1\ncriterion: {name: MSELoss, args: {reduction: sum}}") == new
    assert (
        TrainerConfig(epochs=1).with_overrides(["criterion.name=MSELoss", "criterion.args.reduction=sum"])
        == new
    )
    assert "loss" not in new.to_dict() and new.to_dict()["criterion"]["name"] == "MSELoss"
    with pytest.raises(ConfigError, match=r"criterion.name \(line 2\): unknown torch.nn loss 'MSELos'"):
        TrainerConfig.from_yaml("epochs: 1\ncriterion: MSELos\n")
