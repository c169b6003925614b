"""A real third-party plugin distribution, pip-installed: listed by `vlmreg families`, checked, conformant."""

from __future__ import annotations

import json
import os
import re
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
        check=True,
        capture_output=True,
        text=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "VLMREG_PLUGINS"}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)}


def vlmreg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmreg", *args], capture_output=True, text=True, env=env)


def test_installed_plugin_is_listed_with_its_distribution(installed):
    result = vlmreg("families", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    llava = {r["name"]: r for r in json.loads(result.stdout)}["llava"]
    assert llava["plugin"] == "vlmreg-tiny-llava" and llava["plugin_version"] == "0.1.0"
    assert (
        llava["vision_encoder_attr"] == "model.vision_tower"
        and llava["weight_prefix"] == "model.language_model.layers."
    )


def test_installed_plugin_passes_check_tiny(installed):
    result = vlmreg("check", "--tiny", "llava", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["family"] == "llava" and summary["model_class"] == "LlavaForConditionalGeneration"
    assert summary["num_vision_blocks"] == 2 and summary["lora_presets"]["language+projector"]["modules"] == 16


def test_installed_plugin_passes_the_conformance_suite(installed):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PLUGIN / "tests")],
        capture_output=True,
        text=True,
        env=installed,
        cwd=PLUGIN,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "14 passed" in result.stdout


def test_the_tutorial_trains_the_family_it_built(installed, tmp_path):
    """docs/tutorial.md step 10: its colour.toml previews with no unknown token and trains (two steps here,
    and one format warm-up step) with the installed plugin, without the unknown-token warning."""

    tutorial = (ROOT / "docs" / "tutorial.md").read_text()
    body = next(b for b in re.findall(r"```toml\n(.*?)```", tutorial, re.S) if b.startswith("# colour.toml"))
    (tmp_path / "colour.toml").write_text(body)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "vlmreg", *argv], capture_output=True, text=True, env=installed, cwd=tmp_path
        )

    preview = run("data", "preview", "colour.toml", "--n", "1", "--json")
    assert preview.returncode == 0, preview.stderr
    record = json.loads(preview.stdout)
    assert record["unknown_tokens"]["unknown"] == 0 and record["warning"] is None
    assert record["samples"][0]["model_text"].endswith(
        "What colour is the shape ? Red , Green or Blue ? </s> assistant :"
    )
    train = run(
        "train",
        "colour.toml",
        "--set",
        "trainer.steps=2",
        "--set",
        "trainer.format_warmup_steps=1",
        "--set",
        "eval.every=0",
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert "unknown token" not in train.stdout + train.stderr
    records = [
        json.loads(line) for line in (tmp_path / "runs" / "llava_colour" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2]
