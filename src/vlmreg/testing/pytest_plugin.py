"""pytest plugin (entry point ``pytest11``): fixtures for testing vlmreg family plugins.

Loaded automatically in any environment where vlmreg is installed. It imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vlmreg.sdk.registry import FamilyRegistry, get_registry, reset_registry


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
