"""Typed run configuration: the schema (`schema`), YAML loading and `key=value` overrides (`load`), value
checks (`checks`).

Every error here is a `ConfigError` whose message is one line naming the key and what to do;
the CLI turns it into exit code 2 before any process group or model exists.

The package imports nothing from h3train but `errors`, so every other module can read the schema.
Checks that need more than the values (the task table, each chosen extension-table entry, the model's
module names, files the config names) are `h3train.run.checks.check`; `h3train.run.preflight.load_checked`
loads and runs both.
"""

from __future__ import annotations

from .load import TEXT_OR_LIST_KEYS, anchor_sample_paths, config_layers, load_config, parse_overrides, to_yaml
from .schema import (
    SAMPLE_FIELDS,
    SAMPLES_KEY,
    CfgConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DebugConfig,
    EmaConfig,
    GuardConfig,
    LoggingConfig,
    LoraConfig,
    LossWeights,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    SampleRequestConfig,
    SyntheticDataConfig,
    TaskConfig,
    TimestepConfig,
    TrainConfig,
    ValidationConfig,
    WandbConfig,
    choices,
    get_key,
    leaf_types,
    register_choice,
    register_entry,
    sample_key,
)
from .values import SEED_MAX, TIMEOUT_MAX_S, DatasetSpec, check_values, dataset_specs, measures_held_out_loss

__all__ = [
    "ModelConfig",
    "TaskConfig",
    "SyntheticDataConfig",
    "DataConfig",
    "ParallelConfig",
    "LossWeights",
    "TimestepConfig",
    "EmaConfig",
    "TrainConfig",
    "OptimConfig",
    "WandbConfig",
    "LoggingConfig",
    "CfgConfig",
    "CheckpointConfig",
    "DebugConfig",
    "LoraConfig",
    "SampleRequestConfig",
    "GuardConfig",
    "ValidationConfig",
    "Config",
    "register_choice",
    "register_entry",
    "choices",
    "get_key",
    "leaf_types",
    "SAMPLES_KEY",
    "SAMPLE_FIELDS",
    "sample_key",
    "parse_overrides",
    "config_layers",
    "load_config",
    "to_yaml",
    "TEXT_OR_LIST_KEYS",
    "anchor_sample_paths",
    "check_values",
    "SEED_MAX",
    "TIMEOUT_MAX_S",
    "DatasetSpec",
    "dataset_specs",
    "measures_held_out_loss",
]
