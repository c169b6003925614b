"""pytest plugin (entry point ``pytest11``): fixtures for testing vlmreg family plugins.

Loaded automatically in any environment where vlmreg is installed. It imports nothing heavy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from vlmreg.sdk.errors import PluginError
from vlmreg.sdk.registry import FamilyRegistry, get_registry, register_plugin, reset_registry, unregister_plugin


@pytest.fixture
def vlmreg_registry() -> FamilyRegistry:
    """The process's family registry (installed plugins and in-process ones)."""
    return get_registry()


@pytest.fixture
def vlmreg_fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget loaded plugins before and after the test, so it can change ``VLMREG_PLUGINS`` or register plugins."""
    reset_registry()
    yield
    monkeypatch.undo()
    reset_registry()


@pytest.fixture
def vlmreg_add_plugin(vlmreg_fresh_registry: None) -> Iterator[Callable[[object, str], None]]:
    """``add(plugin, name)`` registers an in-process plugin object for this test (`vlmreg.register_plugin`); every
    plugin added is removed afterwards, and the registries start fresh before and after."""
    names: list[str] = []

    def add(plugin: object, name: str) -> None:
        register_plugin(plugin, name=name)
        names.append(name)

    yield add
    for name in names:
        with contextlib.suppress(PluginError):  # a test may have removed it already
            unregister_plugin(name)
