"""Run configuration: TOML -> attrs (strict, every error at once), then filled and checked against the family."""

from vlmreg.config.load import ConfigError, apply_sets, load_config, parse_config
from vlmreg.config.schema import (
    BroadcastSection,
    DataSection,
    EvalSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    RunConfig,
    TrainerSection,
    VlmSection,
)

__all__ = [
    "BroadcastSection",
    "ConfigError",
    "DataSection",
    "EvalSection",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "RewardSection",
    "RolloutSection",
    "RunConfig",
    "TrainerSection",
    "VlmSection",
    "apply_sets",
    "load_config",
    "parse_config",
]
