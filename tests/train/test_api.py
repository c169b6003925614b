"""`vlmreg.train(...)`: a run from Python on the CLI's code path, with callbacks, returning what the run left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vlmreg

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml"
QUICK = [
    "trainer.format_warmup_steps=0",
    "eval.every=0",
    "logging.rollout_page_every=0",
    "trainer.prompts_per_step=2",
    "rollout.group_size=2",
    "trainer.save_every=2",
]


def test_train_from_python_with_callbacks(tmp_path):
    steps, batches, checkpoints, lines = [], [], [], []
    result = vlmreg.train(
        MAIN,
        overrides=[*QUICK, "trainer.steps=3"],
        output_dir=tmp_path / "run",
        log=lines.append,
        on_step=steps.append,
        on_rollouts=lambda step, trajectories: batches.append((step, len(trajectories))),
        on_checkpoint=checkpoints.append,
    )
    assert isinstance(result, vlmreg.RunResult) and result.main
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3] and steps == records  # the callback saw what metrics.jsonl holds
    assert result.step == 3 and result.final == records[-1]
    assert batches == [(1, 4), (2, 4), (3, 4)]  # 2 prompts x 2 samples each step
    assert [p.name for p in checkpoints] == ["step_000002", "step_000003"]
    assert result.checkpoint == tmp_path / "run" / "checkpoints" / "step_000003"
    assert f"output: {tmp_path / 'run'}" in lines


def test_a_run_config_object_with_overrides_and_clear_errors(tmp_path):
    config = vlmreg.load_config(MAIN)
    result = vlmreg.train(config, overrides=[*QUICK, "trainer.steps=1"], output_dir=tmp_path / "a", log=lambda m: None)
    assert result.step == 1
    with pytest.raises(vlmreg.ConfigError, match="trainer.algorithm"):
        vlmreg.train(MAIN, overrides=["trainer.algorithm=grop"], output_dir=tmp_path / "b", log=lambda m: None)
    with pytest.raises(vlmreg.VlmregError, match="already holds a run"):  # the same run directory rules as the CLI
        vlmreg.train(config, overrides=[*QUICK, "trainer.steps=1"], output_dir=tmp_path / "a", log=lambda m: None)
