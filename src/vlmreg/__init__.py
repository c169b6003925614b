"""vlmreg: reinforcement-learning training of vision-language models, built on a registry of model families.

The SDK names (``FamilyDescriptor``, ``hookimpl``, the errors, the registry) import without torch, so
``vlmreg families`` answers fast. ``resolve`` and ``ResolvedFamily`` load torch on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmreg.sdk import (
    ALL_LINEAR,
    DescriptorError,
    Engine,
    FamilyDescriptor,
    LoraPreset,
    MetricsSink,
    Objective,
    PluginError,
    PrefixRenames,
    RegistryConflictError,
    ResolutionError,
    Reward,
    RewardError,
    Task,
    ThinkingMode,
    Transport,
    UnknownFamilyError,
    UnknownRewardError,
    UnknownTaskError,
    VideoSampling,
    VisionTokens,
    VlmregError,
    get_engine_registry,
    get_environment_registry,
    get_objective_registry,
    get_registry,
    get_reward_registry,
    get_sink_registry,
    get_task_registry,
    get_transport_registry,
    hookimpl,
    register_plugin,
    reset_registry,
    unregister_plugin,
)
from vlmreg.sdk.environment import EnvironmentSpec
from vlmreg.sdk.version import __version__

if TYPE_CHECKING:
    from vlmreg.broadcast.plan import WeightPlan
    from vlmreg.config import ConfigError, load_config
    from vlmreg.envs.gym import gym_environment
    from vlmreg.loading.load import LoadedModel, load
    from vlmreg.resolution import ResolvedFamily, resolve

_LAZY = {
    "resolve": "vlmreg.resolution",
    "ResolvedFamily": "vlmreg.resolution",
    "load": "vlmreg.loading.load",
    "LoadedModel": "vlmreg.loading.load",
    "load_config": "vlmreg.config",
    "ConfigError": "vlmreg.config",
    "Trainer": "vlmreg.train.recipe",
    "RunResult": "vlmreg.train.api",
    "TrainingInterrupted": "vlmreg.train.api",
    "WeightPlan": "vlmreg.broadcast.plan",  # a transport's sender: what to send (checkpoint names and tensors)
    "gym_environment": "vlmreg.envs.gym",  # a plugin's environment from a gymnasium-style game
}


def __getattr__(name: str) -> Any:
    if name == "train":  # the package vlmreg.train is callable: vlmreg.train(config, ...) runs a training
        # deferred: a lazy attribute of the package (PEP 562)
        import importlib  # noqa: PLC0415

        return importlib.import_module("vlmreg.train")
    if name in _LAZY:
        # deferred: a lazy attribute of the package (PEP 562)
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlmreg' has no attribute {name!r}")


def get_family(name: str) -> FamilyDescriptor:
    """The installed family called ``name`` (raises `UnknownFamilyError` with suggestions)."""
    return get_registry().get(name)


__all__ = [
    "ALL_LINEAR",
    "ConfigError",
    "DescriptorError",
    "Engine",
    "EnvironmentSpec",
    "FamilyDescriptor",
    "LoadedModel",
    "LoraPreset",
    "MetricsSink",
    "Objective",
    "PluginError",
    "RegistryConflictError",
    "ResolutionError",
    "ResolvedFamily",
    "RunResult",
    "Reward",
    "RewardError",
    "Task",
    "ThinkingMode",
    "PrefixRenames",
    "Transport",
    "Trainer",
    "TrainingInterrupted",
    "UnknownFamilyError",
    "UnknownRewardError",
    "UnknownTaskError",
    "VideoSampling",
    "VisionTokens",
    "VlmregError",
    "WeightPlan",
    "__version__",
    "get_engine_registry",
    "get_environment_registry",
    "get_family",
    "get_objective_registry",
    "get_registry",
    "get_reward_registry",
    "get_sink_registry",
    "get_task_registry",
    "get_transport_registry",
    "gym_environment",
    "hookimpl",
    "load",
    "load_config",
    "register_plugin",
    "reset_registry",
    "resolve",
    "train",
    "unregister_plugin",
]
