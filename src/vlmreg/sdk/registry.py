"""The family registry: every installed `FamilyDescriptor`, by name and by ``model_type``.

``get_registry()`` loads the plugins on first use and keeps the result for the process. Tests and
notebooks can add a plugin object with ``register_plugin`` (it goes through the same hooks as an
installed one) and start over with ``reset_registry``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from vlmreg.sdk.descriptor import FamilyDescriptor
from vlmreg.sdk.errors import PluginError, RegistryConflictError, UnknownFamilyError, UnknownTaskError, did_you_mean
from vlmreg.sdk.plugins import ENV_VAR, PluginHost, PluginInfo

__all__ = ["FamilyRegistry", "TaskRegistry", "get_plugin_host", "get_registry", "get_task_registry", "register_plugin", "reset_registry", "unregister_plugin"]

_INSTALL_HINT = (
    "Install a plugin that registers it (pip install <its distribution>; `vlmreg plugins` lists what is loaded), "
    f"and check that {ENV_VAR} does not leave it out."
)


class FamilyRegistry:
    """Families by name and by ``model_type``, each with the plugin that registered it."""

    def __init__(self) -> None:
        self._families: dict[str, FamilyDescriptor] = {}
        self._by_model_type: dict[str, str] = {}
        self._plugins: dict[str, PluginInfo] = {}

    def add(self, descriptor: FamilyDescriptor, plugin: PluginInfo) -> None:
        """Add one family; a name or ``model_type`` already taken is a `RegistryConflictError`."""
        if not isinstance(descriptor, FamilyDescriptor):
            raise PluginError(
                f"{plugin.origin} called register() with a {type(descriptor).__name__}; it takes a vlmreg.FamilyDescriptor"
            )
        if descriptor.name in self._families:
            other = self._plugins[descriptor.name]
            raise RegistryConflictError(
                f"family {descriptor.name!r} is registered twice: by {other.origin} and by {plugin.origin}. "
                f"Uninstall one, or pick one with {ENV_VAR}."
            )
        for model_type in descriptor.model_types:
            if model_type in self._by_model_type:
                owner = self._by_model_type[model_type]
                raise RegistryConflictError(
                    f"model_type {model_type!r} is claimed by family {owner!r} from {self._plugins[owner].origin} "
                    f"and by family {descriptor.name!r} from {plugin.origin}. Uninstall one, or pick one with {ENV_VAR}."
                )
        self._families[descriptor.name] = descriptor
        self._plugins[descriptor.name] = plugin
        for model_type in descriptor.model_types:
            self._by_model_type[model_type] = descriptor.name

    def get(self, name: str) -> FamilyDescriptor:
        """The family called ``name``, or `UnknownFamilyError` with suggestions."""
        try:
            return self._families[name]
        except KeyError:
            raise UnknownFamilyError(
                f"Unknown family {name!r}.{did_you_mean(name, self._families)} "
                f"Installed families: {self._listing()}. {_INSTALL_HINT}"
            ) from None

    def for_model_type(self, model_type: str) -> FamilyDescriptor:
        """The family claiming a transformers ``config.model_type``, or `UnknownFamilyError`."""
        try:
            return self._families[self._by_model_type[model_type]]
        except KeyError:
            raise UnknownFamilyError(
                f"No installed family claims model_type {model_type!r}.{did_you_mean(model_type, self._by_model_type)} "
                f"Installed families: {self._listing()}. {_INSTALL_HINT}"
            ) from None

    def plugin_of(self, name: str) -> PluginInfo:
        """The plugin (distribution, version, entry point) that registered family ``name``."""
        self.get(name)
        return self._plugins[name]

    def names(self) -> list[str]:
        return sorted(self._families)

    def __iter__(self) -> Iterator[FamilyDescriptor]:
        return (self._families[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._families)

    def __contains__(self, name: object) -> bool:
        return name in self._families

    def _listing(self) -> str:
        if not self._families:
            return "none"
        return ", ".join(f"{n} ({', '.join(self._families[n].model_types)})" for n in self.names())


class TaskRegistry:
    """Tasks by name, each with the plugin that registered it."""

    def __init__(self) -> None:
        self._tasks: dict[str, Any] = {}
        self._plugins: dict[str, PluginInfo] = {}

    def add(self, task: Any, plugin: PluginInfo) -> None:
        from vlmreg.sdk.task import Task

        if not isinstance(task, Task):
            raise PluginError(f"{plugin.origin} called register() with a {type(task).__name__}; it takes a vlmreg.Task")
        if task.name in self._tasks:
            raise RegistryConflictError(
                f"task {task.name!r} is registered twice: by {self._plugins[task.name].origin} and by {plugin.origin}"
            )
        self._tasks[task.name] = task
        self._plugins[task.name] = plugin

    def get(self, name: str) -> Any:
        try:
            return self._tasks[name]
        except KeyError:
            raise UnknownTaskError(
                f"Unknown task {name!r}.{did_you_mean(name, self._tasks)} Tasks: {', '.join(self.names()) or 'none'}"
            ) from None

    def plugin_of(self, name: str) -> PluginInfo:
        self.get(name)
        return self._plugins[name]

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def __contains__(self, name: object) -> bool:
        return name in self._tasks


_lock = threading.RLock()
_host: PluginHost | None = None
_registry: FamilyRegistry | None = None
_tasks: TaskRegistry | None = None
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


def get_registry() -> FamilyRegistry:
    """The process's family registry, built on first use from every loaded plugin."""
    global _registry
    with _lock:
        if _registry is None:
            host = get_plugin_host()
            registry = FamilyRegistry()

            def make_register(info: PluginInfo) -> dict[str, Any]:
                return {"register": lambda descriptor: registry.add(descriptor, info)}

            host.call_each("vlmreg_register_families", make_register)
            _registry = registry
        return _registry


def get_task_registry() -> TaskRegistry:
    """The process's task registry, built on first use from every loaded plugin (the bundled tasks included)."""
    global _tasks
    with _lock:
        if _tasks is None:
            host = get_plugin_host()
            tasks = TaskRegistry()
            host.call_each("vlmreg_register_tasks", lambda info: {"register": lambda task: tasks.add(task, info)})
            _tasks = tasks
        return _tasks


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
    global _host, _registry, _tasks
    _registry = None
    _tasks = None
    if host:
        _host = None
