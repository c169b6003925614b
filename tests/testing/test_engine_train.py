"""`vlmreg check --engine vllm --train N`'s training run (`vlmreg.testing.engine_train`): its config is a valid run
for every bundled family, and the run itself (``vlmreg train`` as a subprocess, per-step ``mismatch_kl`` read from its
``metrics.jsonl``) works end to end on a CPU with `vlmreg serve` launched in vLLM's place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.engine_parity import DEFAULT_SERVER_ARGS
from vlmreg.testing.engine_train import MISMATCH_KL_LIMIT, run_training, train_config


@pytest.mark.parametrize("family", get_registry().names())
def test_the_training_config_is_a_valid_vllm_run_for_every_family(family: str, tmp_path: Path):
    raw = train_config(
        family,
        None,
        steps=3,
        dtype="bfloat16",
        server_args=DEFAULT_SERVER_ARGS,
        gpu_memory_fraction=0.08,
        output_dir=tmp_path,
    )
    unsupported = get_registry().get(family).vllm_unsupported
    if unsupported:  # a family vLLM cannot serve: the run is refused with the descriptor's reason
        with pytest.raises(ConfigError, match=re.escape(unsupported[:60])):
            resolve_config(parse_config(raw))
        return
    rc = resolve_config(parse_config(raw))
    rollout, trainer = rc.config.rollout, rc.config.trainer
    assert (rollout.engine, rollout.server, rollout.launch, rc.config.broadcast.transport) == (
        "openai",
        "vllm",
        True,
        "ipc",
    )
    assert rollout.server_args == list(DEFAULT_SERVER_ARGS) and trainer.max_off_policy_steps == 0 and trainer.steps == 3


def test_the_training_run_reports_mismatch_kl_every_step_and_runs_again_in_the_same_place(tmp_path: Path):
    where = {"server": "vlmreg", "device": "cpu", "transport": "gloo", "timeout_s": 300}
    results = run_training("qwen3_vl", steps=2, dtype="float32", output_dir=tmp_path, **where)
    assert [r.name for r in results] == ["train step 1: mismatch_kl", "train step 2: mismatch_kl", "vlmreg train"], (
        results
    )
    assert all(r.status == "PASS" for r in results), results
    assert all(0 <= r.value < MISMATCH_KL_LIMIT for r in results[:2])
    assert (tmp_path / "train.toml").read_text().startswith("# vlmreg check --engine vllm --train 2")
    # a retry: not refused as a taken run dir
    again = run_training("qwen3_vl", steps=1, dtype="float32", output_dir=tmp_path, **where)
    assert [(r.name, r.status) for r in again] == [("train step 1: mismatch_kl", "PASS"), ("vlmreg train", "PASS")], (
        again
    )
