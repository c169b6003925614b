"""The family registry: every installed `FamilyDescriptor`, by name and by ``model_type``.

``get_registry()`` loads the plugins on first use and keeps the result for the process. Tests and
notebooks can add a plugin object with ``register_plugin`` (it goes through the same hooks as an
installed one) and start over with ``reset_registry``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, TypeVar

from vlmreg.sdk.descriptor import FamilyDescriptor
from vlmreg.sdk.engine import Engine
from vlmreg.sdk.environment import EnvironmentSpec
from vlmreg.sdk.errors import (
    PluginError,
    RegistryConflictError,
    UnknownEngineError,
    UnknownEnvironmentError,
    UnknownFamilyError,
    UnknownObjectiveError,
    UnknownRewardError,
    UnknownSinkError,
    UnknownTaskError,
    UnknownTransportError,
    did_you_mean,
)
from vlmreg.sdk.objective import Objective
from vlmreg.sdk.plugins import ENV_VAR, PluginHost, PluginInfo
from vlmreg.sdk.reward import Reward
from vlmreg.sdk.sink import MetricsSink
from vlmreg.sdk.task import Task
from vlmreg.sdk.transport import NO_TRANSPORT, Transport

__all__ = [
    "EngineRegistry",
    "EnvironmentRegistry",
    "FamilyRegistry",
    "ObjectiveRegistry",
    "RewardRegistry",
    "SinkRegistry",
    "TaskRegistry",
    "TransportRegistry",
    "get_engine_registry",
    "get_environment_registry",
    "get_objective_registry",
    "get_plugin_host",
    "get_registry",
    "get_reward_registry",
    "get_sink_registry",
    "get_task_registry",
    "get_transport_registry",
    "register_plugin",
    "reset_registry",
    "unregister_plugin",
]

_INSTALL_HINT = (
    "Install a plugin that registers it (pip install <its distribution>; `vlmreg plugins` lists what is loaded), "
    f"and check that {ENV_VAR} does not leave it out."
)


class _NamedRegistry:
    """Things registered by name, each with the plugin that registered it; a name taken twice is an error."""

    kind = "item"

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._plugins: dict[str, PluginInfo] = {}

    def _expected(self) -> type[Any]:
        raise NotImplementedError

    def _unknown(self, name: str) -> Exception:
        raise NotImplementedError

    def add(self, item: Any, plugin: PluginInfo) -> None:
        """Add one item; a name already taken is a `RegistryConflictError` naming both plugins."""
        if not isinstance(item, self._expected()):
            raise PluginError(
                f"{plugin.origin} called register() with a {type(item).__name__}; it takes a "
                f"vlmreg.{self._expected().__name__}"
            )
        if item.name in self._items:
            raise RegistryConflictError(
                f"{self.kind} {item.name!r} is registered twice: by {self._plugins[item.name].origin} and by "
                f"{plugin.origin}. Uninstall one, or pick one with {ENV_VAR}."
            )
        self._items[item.name] = item
        self._plugins[item.name] = plugin

    def get(self, name: str) -> Any:
        """The item called ``name``, or an unknown-name error with suggestions."""
        try:
            return self._items[name]
        except KeyError:
            raise self._unknown(name) from None

    def plugin_of(self, name: str) -> PluginInfo:
        """The plugin (distribution, version, entry point) that registered ``name``."""
        self.get(name)
        return self._plugins[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __iter__(self) -> Iterator[Any]:
        return (self._items[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


class FamilyRegistry(_NamedRegistry):
    """Families by name and by ``model_type``, each with the plugin that registered it."""

    kind = "family"

    def __init__(self) -> None:
        super().__init__()
        self._by_model_type: dict[str, str] = {}

    def _expected(self) -> type[Any]:
        return FamilyDescriptor

    def add(self, descriptor: FamilyDescriptor, plugin: PluginInfo) -> None:
        """Add one family; a name or ``model_type`` already taken is a `RegistryConflictError`."""
        if isinstance(descriptor, FamilyDescriptor):
            for model_type in descriptor.model_types:
                if model_type in self._by_model_type:
                    owner = self._by_model_type[model_type]
                    raise RegistryConflictError(
                        f"model_type {model_type!r} is claimed by family {owner!r} from {self._plugins[owner].origin} "
                        f"and by family {descriptor.name!r} from {plugin.origin}. Uninstall one, or pick one with "
                        f"{ENV_VAR}."
                    )
        super().add(descriptor, plugin)
        for model_type in descriptor.model_types:
            self._by_model_type[model_type] = descriptor.name

    def _unknown(self, name: str) -> Exception:
        return UnknownFamilyError(
            f"Unknown family {name!r}.{did_you_mean(name, self._items)} Installed families: {self._listing()}. "
            f"{_INSTALL_HINT}"
        )

    def for_model_type(self, model_type: str) -> FamilyDescriptor:
        """The family claiming a transformers ``config.model_type``, or `UnknownFamilyError`."""
        try:
            return self._items[self._by_model_type[model_type]]
        except KeyError:
            raise UnknownFamilyError(
                f"No installed family claims model_type {model_type!r}.{did_you_mean(model_type, self._by_model_type)} "
                f"Installed families: {self._listing()}. {_INSTALL_HINT}"
            ) from None

    def _listing(self) -> str:
        if not self._items:
            return "none"
        return ", ".join(f"{n} ({', '.join(self._items[n].model_types)})" for n in self.names())


class TaskRegistry(_NamedRegistry):
    """Tasks by name, each with the plugin that registered it."""

    kind = "task"

    def _expected(self) -> type[Any]:
        return Task

    def _unknown(self, name: str) -> Exception:
        return UnknownTaskError(
            f"Unknown task {name!r}.{did_you_mean(name, self._items)} Tasks: {', '.join(self.names()) or 'none'}"
        )


class ObjectiveRegistry(_NamedRegistry):
    """Objectives (policy-gradient losses) by name, each with the plugin that registered it."""

    kind = "objective"

    def _expected(self) -> type[Any]:
        return Objective

    def _unknown(self, name: str) -> Exception:
        return UnknownObjectiveError(
            f"Unknown objective {name!r}.{did_you_mean(name, self._items)} Objectives: "
            f"{', '.join(self.names()) or 'none'}"
        )


class RewardRegistry(_NamedRegistry):
    """Reward functions by name (``[reward] functions``, a task's ``reward``), each with the plugin that registered
    it."""

    kind = "reward"

    def _expected(self) -> type[Any]:
        return Reward

    def unknown_message(self, name: str) -> str:
        """``unknown reward 'x'. Did you mean 'y'? Rewards: ...``: the one wording used everywhere."""
        return f"unknown reward {name!r}.{did_you_mean(name, self._items)} Rewards: {', '.join(self.names()) or 'none'}"

    def _unknown(self, name: str) -> Exception:
        return UnknownRewardError(self.unknown_message(name))


class EngineRegistry(_NamedRegistry):
    """Rollout engines by name, each with the plugin that registered it."""

    kind = "rollout engine"

    def _expected(self) -> type[Any]:
        return Engine

    def _unknown(self, name: str) -> Exception:
        return UnknownEngineError(
            f"Unknown rollout engine {name!r}.{did_you_mean(name, self._items)} Rollout engines: "
            f"{', '.join(self.names()) or 'none'}"
        )


class EnvironmentRegistry(_NamedRegistry):
    """Environments by name (a task's ``environment``, ``[rollout] environment``, ``vlmreg env serve``)."""

    kind = "environment"

    def _expected(self) -> type[Any]:
        return EnvironmentSpec

    def _unknown(self, name: str) -> Exception:
        return UnknownEnvironmentError(
            f"Unknown environment {name!r}.{did_you_mean(name, self._items)} Environments: "
            f"{', '.join(self.names()) or 'none'}"
        )


class SinkRegistry(_NamedRegistry):
    """Metrics sinks by name, each with the plugin that registered it."""

    kind = "metrics sink"

    def _expected(self) -> type[Any]:
        return MetricsSink

    def _unknown(self, name: str) -> Exception:
        return UnknownSinkError(
            f"Unknown metrics sink {name!r}.{did_you_mean(name, self._items)} Sinks: "
            f"{', '.join(self.names()) or 'none'}"
        )


class TransportRegistry(_NamedRegistry):
    """Weight transports by name (``[broadcast] transport``), each with the plugin that registered it (the config
    rules that read their declared properties are `vlmreg.config.rules`)."""

    kind = "transport"

    def _expected(self) -> type[Any]:
        return Transport

    def _unknown(self, name: str) -> Exception:
        return UnknownTransportError(
            f"Unknown transport {name!r}.{did_you_mean(name, [*self._items, NO_TRANSPORT])} "
            f"Transports: {', '.join(self.names()) or 'none'} ({NO_TRANSPORT!r}: no weights are sent)"
        )


_R = TypeVar("_R", bound=_NamedRegistry)
_lock = threading.RLock()
_host: PluginHost | None = None
_built: dict[str, _NamedRegistry] = {}  # hook name -> its registry, filled on first use
_extra: list[tuple[Any, PluginInfo]] = []


def get_plugin_host() -> PluginHost:
    """The process's plugin host, loading the installed plugins on first use."""
    global _host
    with _lock:
        if _host is None:
            host = PluginHost()
            host.load_builtins()
            host.load_entry_points()
            for plugin, info in _extra:
                host.register(plugin, info)
            host.check()
            _host = host
        return _host


def _filled(hook: str, make: type[_R]) -> _R:
    """The registry ``hook`` fills, built on first use from every loaded plugin (each item attributed to its plugin)."""
    with _lock:
        if hook not in _built:
            registry = make()
            get_plugin_host().call_each(hook, lambda info: {"register": lambda item: registry.add(item, info)})
            _built[hook] = registry
        return _built[hook]  # type: ignore[return-value]


def get_registry() -> FamilyRegistry:
    """The process's family registry, built on first use from every loaded plugin."""
    return _filled("vlmreg_register_families", FamilyRegistry)


def get_task_registry() -> TaskRegistry:
    """The process's task registry (the bundled tasks included)."""
    return _filled("vlmreg_register_tasks", TaskRegistry)


def get_objective_registry() -> ObjectiveRegistry:
    """The process's objective registry (``[trainer] algorithm``)."""
    return _filled("vlmreg_register_objectives", ObjectiveRegistry)


def get_engine_registry() -> EngineRegistry:
    """The process's rollout-engine registry (``[rollout] engine``)."""
    return _filled("vlmreg_register_rollout_engines", EngineRegistry)


def get_environment_registry() -> EnvironmentRegistry:
    """The process's environment registry (the bundled tasks' environments included)."""
    return _filled("vlmreg_register_environments", EnvironmentRegistry)


def get_sink_registry() -> SinkRegistry:
    """The process's metrics-sink registry (``[logging] sinks``)."""
    return _filled("vlmreg_register_metrics_sinks", SinkRegistry)


def get_reward_registry() -> RewardRegistry:
    """The process's reward registry (``[reward] functions``)."""
    return _filled("vlmreg_register_rewards", RewardRegistry)


def get_transport_registry() -> TransportRegistry:
    """The process's weight-transport registry (``[broadcast] transport``)."""
    return _filled("vlmreg_register_transports", TransportRegistry)


def register_plugin(plugin: Any, name: str | None = None) -> PluginInfo:
    """Add a plugin object (a module or any object with ``@hookimpl`` functions) in this process.

    It is kept across `reset_registry` until `unregister_plugin`. Its families are visible on the
    next ``get_registry()`` call.
    """
    info = PluginInfo(name=name or getattr(plugin, "__name__", None) or type(plugin).__name__)
    with _lock:
        if any(existing.name == info.name for _, existing in _extra):
            raise PluginError(f"a plugin named {info.name!r} is already registered in process")
        if _host is not None:
            _host.register(plugin, info)
            try:
                _host.check()
            except PluginError:
                _host.unregister(info.name)
                raise
        _extra.append((plugin, info))
        _invalidate(host=False)
    return info


def unregister_plugin(name: str) -> None:
    """Remove a plugin added with `register_plugin`."""
    with _lock:
        kept = [(p, i) for p, i in _extra if i.name != name]
        if len(kept) == len(_extra):
            raise PluginError(f"no plugin named {name!r} was registered in process")
        _extra[:] = kept
        if _host is not None:
            _host.unregister(name)
        _invalidate(host=False)


def reset_registry() -> None:
    """Forget loaded plugins and families; the next call reloads them (after changing VLMREG_PLUGINS, say)."""
    with _lock:
        _invalidate(host=True)


def _invalidate(*, host: bool) -> None:
    global _host
    _built.clear()
    if host:
        _host = None
