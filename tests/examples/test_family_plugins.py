"""Three non-Qwen third-party family plugins, pip-installed: Gemma 3, Idefics3 (SmolVLM) and Mistral 3 (Pixtral).

Each is listed by `vlmreg families` with its distribution, passes `vlmreg check --tiny`, passes its own conformance
suite, and trains its tiny model on the bundled colour task for two steps from its shipped config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "examples" / "plugins"

# (plugin folder, family, distribution, model class)
FAMILIES = [
    ("vlmreg-tiny-gemma3", "gemma3", "vlmreg-tiny-gemma3", "Gemma3ForConditionalGeneration"),
    ("vlmreg-tiny-idefics3", "idefics3", "vlmreg-tiny-idefics3", "Idefics3ForConditionalGeneration"),
    ("vlmreg-tiny-pixtral", "mistral3", "vlmreg-tiny-pixtral", "Mistral3ForConditionalGeneration"),
]
IDS = [family for _, family, _, _ in FAMILIES]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """pip-install the three plugins (real wheel builds, entry points and all) into one private site dir."""
    site = tmp_path_factory.mktemp("site")
    for folder, _, _, _ in FAMILIES:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(site),
                str(PLUGINS / folder),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    env = {k: v for k, v in os.environ.items() if k != "VLMREG_PLUGINS"}
    # the bundled gemma3 / idefics3 families claim the same names and model types: load only these examples
    selected = ",".join(distribution for _, _, distribution, _ in FAMILIES)
    return {**env, "PYTHONPATH": str(site), "VLMREG_PLUGINS": selected}


def vlmreg(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmreg", *args], capture_output=True, text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def families(installed) -> dict[str, dict]:
    result = vlmreg("families", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    return {r["name"]: r for r in json.loads(result.stdout)}


@pytest.mark.parametrize(("folder", "family", "distribution", "model_class"), FAMILIES, ids=IDS)
def test_listed_with_its_distribution(families, folder, family, distribution, model_class):
    row = families[family]
    assert row["plugin"] == distribution and row["plugin_version"] == "0.1.0"
    assert row["model_types"] == [family]
    assert row["weight_prefix"] == f"{row['language_model_attr']}.layers."
    assert row["max_images_per_message"] >= 2 and row["turn_end_tokens"]


@pytest.mark.parametrize(("folder", "family", "distribution", "model_class"), FAMILIES, ids=IDS)
def test_check_tiny(installed, folder, family, distribution, model_class):
    result = vlmreg("check", "--tiny", family, "--json", env=installed)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["ok"] and summary["family"] == family and summary["model_class"] == model_class
    assert summary["num_layers"] == 2 and summary["num_vision_blocks"] == 2
    assert set(summary["lora_presets"]) == {"language", "language+projector", "all-linear"}
    projector = summary["lora_presets"]["language+projector"]
    assert projector["modules"] + projector["parameters"] > summary["lora_presets"]["language"]["modules"]


@pytest.mark.parametrize(("folder", "family", "distribution", "model_class"), FAMILIES, ids=IDS)
def test_conformance_suite_passes(installed, folder, family, distribution, model_class):
    plugin = PLUGINS / folder
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(plugin / "tests")],
        capture_output=True,
        text=True,
        env=installed,
        cwd=plugin,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.parametrize(("folder", "family", "distribution", "model_class"), FAMILIES, ids=IDS)
def test_trains_two_steps_from_its_config(installed, tmp_path, folder, family, distribution, model_class):
    config = PLUGINS / folder / "config.toml"
    out = tmp_path / "run"
    result = vlmreg(
        "train",
        str(config),
        "--set",
        "trainer.steps=2",
        "--set",
        "trainer.format_warmup_steps=2",
        "--output-dir",
        str(out),
        env=installed,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
