"""FSDP2 under torchrun on CPU (gloo): exact gradients, and `vlmreg train` with two processes, resumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MAIN = str(HERE.parents[1] / "examples" / "configs" / "qwen3_vl_tiny.toml")


def torchrun(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5_moe"])
def test_sharded_gradients_equal_one_process(family):
    result = torchrun(str(HERE / "fsdp_gradients.py"), family)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(": OK") == 2


def test_train_with_two_processes_and_resume(tmp_path):
    out = tmp_path / "run"
    common = ["--set", "trainer.format_warmup_steps=2", "--set", "trainer.prompts_per_step=4", "--set", "rollout.group_size=4",
              "--set", "eval.every=2", "--set", "eval.num_samples=8", "--set", "trainer.save_every=2", "--output-dir", str(out)]
    result = torchrun("-m", "vlmreg", "train", MAIN, "--set", "trainer.steps=2", *common)
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun("-m", "vlmreg", "train", MAIN, "--set", "trainer.steps=4", *common, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # written once, by rank 0
    assert all(r["samples"] == 16 and 0.0 <= r["reward_mean"] <= 1.0 for r in records)
    assert records[1]["eval_samples"] == 8.0
    assert (out / "checkpoints" / "latest").read_text() == "step_000004"
