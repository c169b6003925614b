"""The family SDK: descriptors, hooks, plugin loading and the registry. Imports no torch."""

from vlmreg.sdk.descriptor import ALL_LINEAR, LORA_SCOPES, FamilyDescriptor, LoraPreset, ThinkingMode, VisionTokens
from vlmreg.sdk.errors import (
    DescriptorError,
    PluginError,
    RegistryConflictError,
    ResolutionError,
    RewardError,
    UnknownEngineError,
    UnknownFamilyError,
    UnknownObjectiveError,
    UnknownRewardError,
    UnknownTaskError,
    UnknownTransportError,
    VlmregError,
)
from vlmreg.sdk.engine import Engine
from vlmreg.sdk.objective import Objective
from vlmreg.sdk.sink import MetricsSink
from vlmreg.sdk.reward import Reward
from vlmreg.sdk.task import Task
from vlmreg.sdk.transport import Transport
from vlmreg.sdk.weights import PrefixRenames
from vlmreg.sdk.hookspecs import hookimpl, hookspec
from vlmreg.sdk.plugins import ENTRY_POINT_GROUP, ENV_VAR, PluginInfo
from vlmreg.sdk.registry import (
    FamilyRegistry,
    RewardRegistry,
    get_engine_registry,
    get_environment_registry,
    get_objective_registry,
    get_plugin_host,
    get_sink_registry,
    get_registry,
    get_reward_registry,
    get_task_registry,
    get_transport_registry,
    register_plugin,
    reset_registry,
    unregister_plugin,
)

__all__ = [
    "ALL_LINEAR",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "LORA_SCOPES",
    "DescriptorError",
    "Engine",
    "FamilyDescriptor",
    "FamilyRegistry",
    "LoraPreset",
    "MetricsSink",
    "Objective",
    "PluginError",
    "PluginInfo",
    "RegistryConflictError",
    "ResolutionError",
    "Reward",
    "RewardError",
    "RewardRegistry",
    "Task",
    "ThinkingMode",
    "PrefixRenames",
    "Transport",
    "UnknownEngineError",
    "UnknownFamilyError",
    "UnknownObjectiveError",
    "UnknownRewardError",
    "UnknownTaskError",
    "UnknownTransportError",
    "VisionTokens",
    "VlmregError",
    "get_engine_registry",
    "get_environment_registry",
    "get_objective_registry",
    "get_plugin_host",
    "get_sink_registry",
    "get_registry",
    "get_reward_registry",
    "get_task_registry",
    "get_transport_registry",
    "hookimpl",
    "hookspec",
    "register_plugin",
    "reset_registry",
    "unregister_plugin",
]
