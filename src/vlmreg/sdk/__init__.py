"""The family SDK: descriptors, hooks, plugin loading and the registry. Imports no torch."""

from vlmreg.sdk.descriptor import ALL_LINEAR, LORA_SCOPES, FamilyDescriptor, LoraPreset, ThinkingMode, VisionTokens
from vlmreg.sdk.errors import (
    DescriptorError,
    PluginError,
    RegistryConflictError,
    ResolutionError,
    UnknownFamilyError,
    UnknownObjectiveError,
    UnknownTaskError,
    VlmregError,
)
from vlmreg.sdk.objective import Objective
from vlmreg.sdk.task import Task
from vlmreg.sdk.hookspecs import hookimpl, hookspec
from vlmreg.sdk.plugins import ENTRY_POINT_GROUP, ENV_VAR, PluginInfo
from vlmreg.sdk.registry import (
    FamilyRegistry,
    get_objective_registry,
    get_plugin_host,
    get_registry,
    get_task_registry,
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
    "FamilyDescriptor",
    "FamilyRegistry",
    "LoraPreset",
    "Objective",
    "PluginError",
    "PluginInfo",
    "RegistryConflictError",
    "ResolutionError",
    "Task",
    "ThinkingMode",
    "UnknownFamilyError",
    "UnknownObjectiveError",
    "UnknownTaskError",
    "VisionTokens",
    "VlmregError",
    "get_objective_registry",
    "get_plugin_host",
    "get_registry",
    "get_task_registry",
    "hookimpl",
    "hookspec",
    "register_plugin",
    "reset_registry",
    "unregister_plugin",
]
