"""A real third-party plugin distribution, pip-installed: listed by `vlmreg families`, checked, conformant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugins" / "vlmreg-tiny-llava"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """pip-install the example plugin (a real wheel build, entry points and all) into a private site dir."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(PLUGIN)],
        check=True, capture_output=True, text=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "VLMREG_PLUGINS"}
    return {**env, "PYTHONPATH": str(site)}


def vlmreg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmreg", *args], capture_output=True, text=True, env=env)


def test_installed_plugin_is_listed_with_its_distribution(installed):
    result = vlmreg("families", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    llava = {r["name"]: r for r in json.loads(result.stdout)}["llava"]
    assert llava["plugin"] == "vlmreg-tiny-llava" and llava["plugin_version"] == "0.1.0"
    assert llava["vision_encoder_attr"] == "model.vision_tower" and llava["weight_prefix"] == "model.language_model.layers."


def test_installed_plugin_passes_check_tiny(installed):
    result = vlmreg("check", "--tiny", "llava", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["family"] == "llava" and summary["model_class"] == "LlavaForConditionalGeneration"
    assert summary["num_vision_blocks"] == 2 and summary["lora_presets"]["language+projector"]["modules"] == 16


def test_installed_plugin_passes_the_conformance_suite(installed):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PLUGIN / "tests")],
        capture_output=True, text=True, env=installed, cwd=PLUGIN,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "12 passed" in result.stdout
