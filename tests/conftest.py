"""Shared fixtures: fake installed distributions (real entry points on sys.path) and tiny models."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from vlmreg.testing import tiny_model

# Tests never reach the network: a Hub id is looked up in the local cache only, and fails at once if absent.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `vlmreg train`'s parity gate remembers each family's pass here (keyed by the sources and versions), not in ~/.cache
os.environ.setdefault("VLMREG_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"vlmreg-tests-{os.getuid()}"))

_counter = itertools.count()


@pytest.fixture
def make_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vlmreg_fresh_registry: None
) -> Callable[..., str]:
    """Install a distribution the way pip would (a ``.dist-info`` with entry points) into a temp sys.path entry.

    Returns the unique module name it wrote. The registry is reset around the test.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created: list[str] = []

    def make(dist: str, source: str, entry_points: Mapping[str, str] | None = None, version: str = "1.0") -> str:
        module = f"{dist.replace('-', '_')}_{next(_counter)}"
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        eps = entry_points if entry_points is not None else {dist.replace("-", "_"): module}
        lines = "\n".join(f"{name} = {target.replace('MODULE', module)}" for name, target in eps.items())
        (info / "entry_points.txt").write_text(f"[vlmreg]\n{lines}\n")
        created.append(module)
        importlib.invalidate_caches()
        return module

    yield make
    for module in created:
        sys.modules.pop(module, None)


@pytest.fixture(scope="session")
def tiny_qwen3_vl():
    """A tiny random Qwen3-VL model, shared (do not modify it in a test)."""

    return tiny_model("qwen3_vl")
