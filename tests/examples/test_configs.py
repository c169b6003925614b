"""Every shipped config validates, and its header gives the exact command that runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmreg.cli import main
from vlmreg.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.toml"))


def test_there_is_a_tiny_config_per_bundled_family_and_a_gpu_one():
    names = {p.stem for p in CONFIGS}
    assert {"qwen3_vl_tiny", "qwen3_vl_moe_tiny", "qwen3_5_tiny", "qwen3_5_moe_tiny", "qwen3_vl_2b_gpu"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_validates(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    relative = path.relative_to(ROOT)
    assert main(["validate", str(relative)]) == 0, capsys.readouterr().err
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert f"# Run:    vlmreg train {relative}" in header


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_checkpoints_during_the_run(path):
    """Ctrl-C loses the steps since the last checkpoint: each config writes some before its last step."""
    trainer = load_config(path).trainer
    assert 0 < trainer.save_every < trainer.steps, f"{path.name}: trainer.save_every = {trainer.save_every}"
