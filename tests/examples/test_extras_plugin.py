"""A pip-installed third-party plugin brings its own objective and rewards; `vlmreg plugins` lists them; a run uses
each (a trace file proves that they ran)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugins" / "vlmreg-example-extras"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(PLUGIN)],
                   check=True, capture_output=True, text=True)
    base = {k: v for k, v in os.environ.items() if k not in ("VLMREG_PLUGINS", "VLMREG_EXTRAS_TRACE")}
    return {**base, "PYTHONPATH": str(site)}


def vlmreg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmreg", *args], capture_output=True, text=True, env=env)


def test_listed_under_its_distribution(env):
    result = vlmreg("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    record = {r["name"]: r for r in json.loads(result.stdout)}["extras"]
    assert record["distribution"] == "vlmreg-example-extras" and record["version"] == "0.1.0"
    assert record["objectives"] == ["reinforce"] and record["rewards"] == ["one_word", "slow_exact_match"]
    assert record["hooks"] == ["vlmreg_register_objectives", "vlmreg_register_rewards"]


def test_a_run_uses_the_plugin_s_objective_and_rewards(env, tmp_path):
    trace = tmp_path / "trace.txt"
    out = tmp_path / "run"
    result = vlmreg("train", str(PLUGIN / "config.toml"), "--set", "trainer.steps=2", "--output-dir", str(out),
                    env={**env, "VLMREG_EXTRAS_TRACE": str(trace)})
    assert result.returncode == 0, result.stderr[-2000:]
    calls = trace.read_text().split()
    samples = 2 * 4 * 4  # steps x prompts x group
    assert calls.count("one_word") == samples and calls.count("slow_exact_match") == samples
    assert calls.count("objective") >= 2  # at least one micro-batch a step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["clip_fraction"] == 0 for r in records)
