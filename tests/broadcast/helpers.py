"""Helpers shared by the broadcast tests (and importable by their spawned receiver processes)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vlmreg.sdk.registry import get_registry

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


def bundled_families() -> list[str]:
    """Every family registered by a distribution under plugins/ (read from the registry, not hard-coded)."""

    distributions = {tomllib.loads(p.read_text())["project"]["name"] for p in PLUGINS.glob("*/pyproject.toml")}
    registry = get_registry()
    return sorted(name for name in registry.names() if registry.plugin_of(name).distribution in distributions)


def frozen_vision(resolved: Any) -> Any:
    """Freeze the vision tower but not its connectors, as `vlmreg.load` does by default."""
    connector_params = {id(p) for m in resolved.connectors.values() for p in m.parameters()}
    for p in resolved.vision_encoder.parameters():
        if id(p) not in connector_params:
            p.requires_grad_(False)
    return resolved


def assert_state_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Same names, and bitwise the same tensors (dtype and shape included)."""

    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert different == []
